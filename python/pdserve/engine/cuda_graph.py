"""Decode steps replayed from CUDA graphs captured at start-up, one per batch size.

A decode step of B requests runs the graph of the smallest captured size >= B. Its inputs are
fixed buffers the runner refills in place before each replay: row b < B holds request b;
rows B.. repeat row 0 (same token, position, slot and keys), so the padding computes the same
values as row 0 and its KV write stores exactly what row 0 stores. kv_slots keeps one fixed
width (the context length): the triton backend's plan depends only on that width, never on
values; flashinfer's kernels read plan buffers it refills from these inputs before each replay
(``AttentionBackend.before_replay``).

Legend: B requests, Bg captured batch size, Lc context length (kv_slots width), Hd hidden.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from pdserve.config import DeviceConfig
from pdserve.layers.forward_batch import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE  # the type torch.cuda.graph(pool=...) takes and CUDAGraph.pool() returns

logger = logging.getLogger(__name__)


class CudaGraphError(RuntimeError):
    """Capture failed: the message says which size and suggests --disable-cuda-graph."""


class CudaGraphRunner:
    """Owns the captured graphs and their input buffers; the model runner asks ``accepts(fb)``
    and then calls it instead of the model for that forward."""

    def __init__(self, runner, cfg: DeviceConfig):
        self.runner = runner
        self.cfg = cfg
        self.sizes = cfg.cuda_graph_batch_sizes
        self.width = runner.model_config.context_length  # Lc
        dev, n = runner.device, self.sizes[-1]
        i64 = dict(dtype=torch.int64, device=dev)
        self.input_ids, self.positions, self.out_cache_loc = (torch.zeros(n, **i64) for _ in range(3))
        self.prefix_lens, self.seq_lens = torch.zeros(n, **i64), torch.ones(n, **i64)
        self.extend_lens = torch.ones(n, **i64)
        self.kv_slots = torch.zeros(n, self.width, **i64)  # [Bg max, Lc]
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.mempool: _POOL_HANDLE | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.graphs)

    def accepts(self, fb: ForwardBatch) -> bool:
        return (self.enabled and fb.is_decode and fb.dp_num_tokens is None and fb.layer_hook is None
                and fb.batch_size <= self.sizes[-1] and fb.kv_slots.shape[1] <= self.width)

    def _batch(self, bs: int) -> ForwardBatch:
        r = self.runner
        return ForwardBatch(ForwardMode.DECODE, self.input_ids[:bs], self.positions[:bs], self.out_cache_loc[:bs],
                            self.prefix_lens[:bs], self.extend_lens[:bs], self.seq_lens[:bs], self.kv_slots[:bs],
                            r.pool, r.backend)

    def capture(self) -> None:
        """Capture every size, largest first (the smaller ones reuse its memory pool), with a
        progress line; a backend that cannot be captured leaves decode eager, said once."""
        backend = self.runner.backend
        if not backend.supports_cuda_graph:
            logger.warning("CUDA graphs: the %s attention backend cannot be captured yet; decode runs eagerly "
                           "(--attention-backend triton captures)", backend.name)
            return
        S = self.runner.pool.page_size
        backend.init_cuda_graph(self.sizes[-1], self.sizes[-1] * -(-self.width // S), self.runner.device)
        start = time.monotonic()
        for i, bs in enumerate(reversed(self.sizes)):
            logger.info("Capturing CUDA graphs for decode: batch size %d (%d/%d)", bs, i + 1, len(self.sizes))
            try:
                self.graphs[bs] = self._capture_one(bs)
            except Exception as e:
                self.graphs.clear()
                raise CudaGraphError(f"cuda graph capture failed at decode batch size {bs} ({type(e).__name__}: "
                                     f"{e}); start with --disable-cuda-graph") from e
        logger.info("Captured %d CUDA graphs (decode batch <= %d) in %.1f s", len(self.graphs), self.sizes[-1],
                    time.monotonic() - start)

    @torch.inference_mode()
    def _capture_one(self, bs: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        fb = self._batch(bs)  # every row: a one-token request at slot 0 (the pool is empty at start-up)
        fb.attn_metadata = self.runner.backend.graph_metadata(fb, bs)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            # Warm-up outside the capture: kernels compiled, and (last position first) the rotary
            # table grown to the context length, which the captured forward cannot do.
            self.positions[:bs].fill_(self.width - 1)
            self.runner.model(fb)
            self.positions[:bs].zero_()
            self.runner.model(fb)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.mempool):
            out = self.runner.model(fb)  # [Bg, Hd]
        self.mempool = graph.pool()
        return graph, out

    def __call__(self, fb: ForwardBatch) -> torch.Tensor:
        """fb [B] -> hidden [B, Hd], replayed from the graph of size Bg >= B."""
        B, L = fb.batch_size, fb.kv_slots.shape[1]
        bs = self.cfg.graph_size_for(B)
        if bs is None:
            raise RuntimeError(f"CUDA graphs: no graph holds a batch of {B} (check accepts first)")
        for buf, src in ((self.input_ids, fb.input_ids), (self.positions, fb.positions),
                         (self.out_cache_loc, fb.out_cache_loc), (self.prefix_lens, fb.prefix_lens),
                         (self.seq_lens, fb.seq_lens)):
            buf[:B].copy_(src)
            buf[B:bs].copy_(src[:1].expand(bs - B))
        self.kv_slots[:B, :L].copy_(fb.kv_slots)
        self.kv_slots[B:bs, :L].copy_(fb.kv_slots[:1].expand(bs - B, L))
        graph, out = self.graphs[bs]
        self.runner.backend.before_replay(self._batch(bs), bs)
        graph.replay()
        return out[:B]
