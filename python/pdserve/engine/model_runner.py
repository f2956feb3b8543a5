"""Owns the model, the KV pool and the attention backend; turns a scheduled batch into logits.

Legend: T tokens, B requests, L longest KV length, V vocabulary.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from pdserve.config import (
    CacheConfig,
    CompileConfig,
    DeviceConfig,
    ModelConfig,
    ServerArgs,
    SpeculativeConfig,
    deepseek_v4_bounded,
    resolve_index_cache_dtype,
)
from pdserve.distributed.parallel_state import SINGLE, ParallelState
from pdserve.layers.attention.registry import create_backend
from pdserve.layers.cpu_gemm import PackPolicy, pack_linears
from pdserve.layers.forward_batch import ForwardBatch, ForwardMode, LayerHook
from pdserve.mem.kv_budget import KVBudget, device_memory, size_pool
from pdserve.mem.kv_pool import GQAKVPool, KVPool, MLAKVPool, kv_storage_dtype
from pdserve.mem.region_pool import BoundedState, RegionKVPool, RegionSpec

logger = logging.getLogger(__name__)


@dataclass
class ScheduledBatch:
    """What the scheduler decided to run this step (plain Python, filled by the scheduler)."""

    mode: ForwardMode
    input_ids: list[int]  # [T]
    positions: list[int]  # [T]
    out_cache_loc: list[int]  # [T]
    prefix_lens: list[int]  # [B]
    extend_lens: list[int]  # [B]
    rows: list[int]  # [B] rows of the req->token table
    req_uids: tuple[int, ...] | None = None  # [B] Req.uid of each request (DECODE)
    # [K] token indices (into T) whose logits are returned too, after the B last tokens' (input logprobs)
    prompt_logit_index: list[int] | None = None


def kv_pool_budget(model: ModelConfig, cache: CacheConfig, parallel: ParallelState,
                   device: str | torch.device = "cpu", extra_layers: int = 0, rollback: int = 0) -> KVBudget:
    """The pool's size on this rank (mem/kv_budget.py): its byte budget over the bytes one token
    takes here, in the pool's dtype, over the draft's ``extra_layers`` too, with this rank's KV heads;
    a bounded DeepSeek-V4 layout's records (``rollback``: see create_kv_pool) come out of it first."""
    index_dtype = resolve_index_cache_dtype(cache.index_cache_dtype, str(device))
    per_token = model.kv_bytes_per_token(cache.kv_cache_dtype, cache.page_size, bool(cache.state_records),
                                         index_cache_dtype=index_dtype)
    per_token = per_token * (model.num_layers + extra_layers) // model.num_layers
    if not model.is_mla:
        per_token = per_token * _local_kv_heads(model, parallel) // model.num_kv_heads
    exact = cache.max_total_tokens is not None and cache.kv_cache_memory_bytes is None \
        and cache.mem_fraction_static is None
    memory = None if exact else device_memory(torch.device(device))
    records = cache.state_records * model.state_record_bytes(cache.page_size, rollback, extra_layers) \
        if cache.state_records else 0
    return size_pool(cache.page_size, per_token, cache.max_total_tokens, cache.kv_cache_memory_bytes,
                     cache.mem_fraction_static, memory, records)


def _local_kv_heads(model: ModelConfig, parallel: ParallelState) -> int:
    # KV heads split over attention TP; replicated when there are fewer heads than ranks.
    return max(1, model.num_kv_heads // parallel.attention.tp_size)


def create_kv_pool(model: ModelConfig, cache: CacheConfig, parallel: ParallelState,
                   device: str | torch.device = "cpu", extra_layers: int = 0,
                   budget: KVBudget | None = None, rollback: int = 0) -> KVPool:
    """``extra_layers``: a speculative draft's layers after the target's (index num_layers on),
    at the same slots as the target's tokens, so their pages live and die with the request's.
    ``budget``: the size ``kv_pool_budget`` gave (measured here when not given). ``rollback``:
    positions a speculative step may roll back (DeepSeek-V4's bounded layout keeps that many more
    rows in its rings)."""
    if budget is None:
        budget = kv_pool_budget(model, cache, parallel, device, extra_layers, rollback)
    num_pages = budget.num_pages
    layers = model.num_layers + extra_layers
    c = model.hf_config
    store = kv_storage_dtype(cache.kv_cache_dtype, model.torch_dtype)  # fp8: scales stay 1.0 (mem/kv_pool.py)
    if model.state_regions:  # DeepSeek-V4: named per-token regions (mem/region_pool.py)
        # its MTP draft layer attends in a sliding window: it keeps the raw rows only
        draft = tuple(range(model.num_layers, layers))
        specs = tuple(RegionSpec(name, tuple(ls) + (draft if name == "window_kv" else ()), width, rate)
                      for name, ls, width, rate in model.state_regions)
        bounded = None
        if cache.state_records:  # the window and open windows as records (docs/kv-cache.md)
            rings, tails, reuse = deepseek_v4_bounded(c, cache.page_size, rollback)
            bounded = BoundedState(rings, tails, reuse, cache.state_records)
        return RegionKVPool(num_pages, cache.page_size, layers, specs, model.torch_dtype, device, bounded)
    if model.is_mla:
        return MLAKVPool(num_pages, cache.page_size, layers, c.kv_lora_rank,
                         c.qk_rope_head_dim, store, device, compute_dtype=model.torch_dtype,
                         index_head_dim=model.index_head_dim,
                         index_cache_dtype=resolve_index_cache_dtype(cache.index_cache_dtype, str(device)))
    return GQAKVPool(num_pages, cache.page_size, layers, _local_kv_heads(model, parallel), model.head_dim,
                     store, device, compute_dtype=model.torch_dtype)


class ModelRunner:
    """Runs forward passes; knows nothing about requests beyond the ScheduledBatch."""

    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig,
                 parallel: ParallelState = SINGLE, attention_backend: str = "torch_native",
                 seed: int = 0, device: str = "cpu", compile_config: CompileConfig | None = None,
                 device_config: DeviceConfig | None = None, speculative: SpeculativeConfig | None = None):
        """``compile_config`` (``--enable-torch-compile``): decode steps that fit a bucket run
        compiled layers (engine/torch_compile.py); every bucket is compiled here, at start-up.
        ``device_config``: with ``use_cuda_graph``, decode batch sizes are captured here too
        (engine/cuda_graph.py). ``speculative``: when enabled, the draft model is loaded next to
        the target and the pool gets its extra layer. Servers build runners through
        ``build_model_runner``."""
        from pdserve.models.loader import load_model

        self.model_config = model_config
        self.parallel = parallel
        self.device = torch.device(device)
        # On CUDA an FP8 checkpoint stays FP8 (block-scaled GEMMs); on CPU it is dequantized on load.
        self.model = load_model(model_config, parallel, seed=seed, keep_fp8=self.device.type == "cuda")
        if self.device.type != "cpu":
            self.model.to(self.device)
        self.speculative = speculative or SpeculativeConfig()
        self.draft = None  # models.draft.DraftModel when speculation is on
        if self.speculative.enabled:
            from pdserve.models.draft import load_draft

            self.draft = load_draft(model_config, self.speculative, self.model, seed)
            if self.device.type != "cpu":
                self.draft.to(self.device)
        self.cpu_pack_policy = self._pack_cpu_linears(device_config)  # None: F.linear
        spec = self.speculative
        rollback = (spec.num_draft_tokens or spec.num_steps + 1) if spec.enabled else 0
        self.kv_budget = kv_pool_budget(model_config, cache_config, parallel, device, spec.draft_layers, rollback)
        self.pool = create_kv_pool(model_config, cache_config, parallel, device, spec.draft_layers, self.kv_budget,
                                   rollback)
        # Speculation reads every token row's hidden state of an extend (draft extend input).
        self.capture_hidden = self.speculative.enabled
        self.step_hidden: torch.Tensor | None = None  # [T, hidden] of the latest forward, if captured
        self.backend = create_backend(attention_backend)
        self.layer_hook: LayerHook | None = None
        self.last_hidden: torch.Tensor | None = None  # [B, hidden] of the latest forward
        logger.info("KV pool (%s, %s): %s", type(self.pool).__name__, cache_config.kv_cache_dtype,
                    self.kv_budget.describe())
        self.compiled = None  # CompiledDecode when compile_config is enabled
        if compile_config is not None and compile_config.enabled:
            from pdserve.engine.torch_compile import CompiledDecode

            self.compiled = CompiledDecode(self.model, self.backend, compile_config)
            self.compiled.warm_up(self.pool, self.device)
        self.graphs = None  # CudaGraphRunner when decode runs captured CUDA graphs
        if device_config is not None and device_config.use_cuda_graph and self.device.type == "cuda":
            from pdserve.engine.cuda_graph import CudaGraphRunner

            self.graphs = CudaGraphRunner(self, device_config)
            self.graphs.capture()

    def _pack_cpu_linears(self, device_config: DeviceConfig | None) -> PackPolicy | None:
        """Pack the loaded CPU linears for oneDNN where ``--cpu-gemm`` and this host say so
        (layers/cpu_gemm.py); returns the policy they follow. Compiled decode calls the same packed
        weights through the custom op ``pdserve::packed_linear``."""
        from pdserve.engine.device import CpuFeatures, cpu_pack_policy

        if device_config is None or self.device.type != "cpu":
            return None
        features = CpuFeatures.detect()
        if device_config.dtype == "bfloat16" and not features.native_bf16:
            logger.warning("dtype bfloat16 on a CPU without avx512_bf16/AMX: emulated, likely slower than float32")
        policy = cpu_pack_policy(device_config, features)
        if policy is not None:
            packed = sum(pack_linears(m, policy) for m in (self.model, self.draft) if m is not None)
            logger.info("CPU GEMMs: %d linears packed for oneDNN (%s)", packed, policy)
        return policy

    def build_forward_batch(self, batch: ScheduledBatch, req_to_token: torch.Tensor) -> ForwardBatch:
        seq_lens = [p + e for p, e in zip(batch.prefix_lens, batch.extend_lens)]
        per_token = (batch.input_ids, batch.positions, batch.out_cache_loc)
        per_req = (batch.prefix_lens, batch.extend_lens, seq_lens)
        if len(batch.input_ids) == len(batch.rows):
            # One token per request (decode): the six lists make one [6, B] tensor, built and moved
            # once. The scheduler thread builds one every step, beside the forward in flight: each
            # torch call costs it a few microseconds and hands the GIL to the forward's thread.
            ids, positions, loc, prefix, ext, seq = torch.tensor((*per_token, *per_req), dtype=torch.int64).to(
                self.device).unbind(0)
        else:
            ids, positions, loc, prefix, ext, seq = (torch.tensor(x, dtype=torch.int64).to(self.device)
                                                     for x in (*per_token, *per_req))
        max_len = max(seq_lens)
        # The req->token table lives on the host: index it there, move only the batch's rows.
        rows = torch.tensor(batch.rows, dtype=torch.int64, device=req_to_token.device)
        # index_select copies whole rows; req_to_token[rows, :L] gathers element by element (4x slower at 32K)
        kv_slots = req_to_token[:, :max_len].index_select(0, rows).to(self.device)  # [B, L]
        return ForwardBatch(batch.mode, ids, positions, loc, prefix, ext, seq, kv_slots, self.pool, self.backend,
                            self.layer_hook, batch.req_uids, req_rows=tuple(batch.rows))

    @torch.inference_mode()
    def forward(self, batch: ScheduledBatch, req_to_token: torch.Tensor) -> torch.Tensor:
        """Returns the logits of each request's last scheduled token [B, V] (float32), followed by
        those of ``batch.prompt_logit_index`` when it is set ([B + K, V])."""
        return self.run(self.build_forward_batch(batch, req_to_token), batch.prompt_logit_index)

    @torch.inference_mode()
    def run(self, fb: ForwardBatch, prompt_logit_index: list[int] | None = None) -> torch.Tensor:
        """``forward`` of a batch already built (the overlap worker runs it off the scheduler thread,
        which built ``fb`` while it owned the req->token table)."""
        if self.graphs is not None and self.graphs.accepts(fb):
            hidden = self.graphs(fb)  # [T, hidden]; the graph's own plan, prepared from fixed buffers
        else:
            fb.attn_metadata = self.backend.prepare(fb)  # once per forward, before the first layer
            if self.compiled is not None and self.compiled.accepts(fb):
                hidden = self.compiled(fb)  # [T, hidden]
            else:
                hidden = self.model(fb)  # [T, hidden]
        if self.capture_hidden:
            self.step_hidden = hidden
        rows = logit_rows(fb, prompt_logit_index)
        if rows is not None:
            hidden = hidden[rows]  # [B (+ K), hidden]
        # Each request's last hidden state: what a disaggregated prefill sends as aux data.
        self.last_hidden = hidden[:fb.batch_size]  # [B, hidden]
        # The sampler runs on the host (per-request CPU generators keep seeded sampling the same
        # on every device), so logits cross once per step.
        return self.model.compute_logits(hidden).cpu()  # [B (+ K), V]

    @torch.inference_mode()
    def forward_all_rows(self, batch: ScheduledBatch, req_to_token: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """Speculative verify: (logits [T, V] float32 on the host, hidden [T, hidden]) of every
        token row; runs eagerly."""
        fb = self.build_forward_batch(batch, req_to_token)
        fb.attn_metadata = self.backend.prepare(fb)
        hidden = self.model(fb)  # [T, hidden]
        return self.model.compute_logits(hidden).cpu(), hidden

    @torch.inference_mode()
    def draft_forward(self, batch: ScheduledBatch, req_to_token: torch.Tensor, target_hidden: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft over ``batch`` (its KV into the pool's draft layer) with ``target_hidden``
        [T, hidden] (one row per token): (logits [B, V] float32 on the host, hidden [B, hidden]) of
        each request's last row."""
        if self.draft is None:
            raise RuntimeError("draft_forward: this runner has no draft model (speculation is off)")
        fb = self.build_forward_batch(batch, req_to_token)
        fb.attn_metadata = self.backend.prepare(fb)
        hidden = self.draft(fb, target_hidden.to(self.device))  # [T, hidden]
        last = hidden[fb.last_token_index()]  # [B, hidden]
        return self.draft.compute_logits(last).cpu(), last


def build_model_runner(args: ServerArgs, model_config: ModelConfig, parallel: ParallelState = SINGLE,
                       runner_cls: type[ModelRunner] | None = None, device: str | None = None,
                       **kwargs) -> ModelRunner:
    """The one place a server's model runner is built from its arguments: device, attention
    backend, dtype (already in ``model_config``), torch.compile and CUDA graphs. ``device``
    overrides the configured one with a specific GPU (``cuda:3`` for a rank); ``runner_cls`` and
    ``kwargs``: a subclass and its extra arguments (the multi-rank RankModelRunner)."""
    from pdserve.engine.device_check import require_device

    dev = args.device_config()
    require_device(dev)
    cls = runner_cls or ModelRunner
    return cls(model_config, args.cache_config(), parallel, attention_backend=dev.attention_backend,
               seed=args.random_seed, device=device or dev.device, compile_config=args.compile_config(),
               device_config=dev, speculative=args.speculative_config(), **kwargs)


def rank_device(device: str, local_rank: int) -> str:
    """This rank's device: its own GPU on a node (ranks are placed in order), the CPU otherwise."""
    return f"cuda:{local_rank}" if device == "cuda" else device


def logit_rows(fb: ForwardBatch, prompt_logit_index: list[int] | None) -> torch.Tensor | None:
    """Token rows whose logits are computed: each request's last, then the extra ones
    (None: all T rows, already in that order)."""
    if not prompt_logit_index:
        return None if fb.batch_size == fb.num_tokens else fb.last_token_index()
    extra = torch.tensor(prompt_logit_index, dtype=torch.int64, device=fb.input_ids.device)
    return torch.cat([fb.last_token_index(), extra])
