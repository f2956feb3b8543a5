"""How many tokens the KV pool holds: a byte budget over the bytes one token's KV takes.

The budget comes from one of (first that is set):

* ``--kv-cache-memory-bytes N`` (vLLM's flag; its CPU build's ``VLLM_CPU_KVCACHE_SPACE``): N bytes;
* ``--mem-fraction-static F`` (SGLang's flag): the pool gets what is left of F x the device's
  memory after what is already in use (``DeviceMemory.used``);
* neither: ``DEFAULT_KV_CACHE_MEMORY_BYTES``, small on purpose: the pool is zero-filled at start-up
  (resident memory), and tests and ``pdserve up`` start several servers on one small host.

``--max-total-tokens`` caps the tokens any budget gives, and alone sizes the pool exactly.
The budget divides by the bytes per token of the pool's dtype, so an FP8 pool holds 4x the tokens
of an FP32 one in the same memory; there is no other cap.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

DEFAULT_KV_CACHE_MEMORY_BYTES = 256 << 20


@dataclass(frozen=True)
class DeviceMemory:
    """Bytes of the device's memory when the pool is sized (after the weights are loaded).

    ``used`` is what counts against ``--mem-fraction-static``: on a GPU everything in use on it
    (a GPU serves one server, SGLang's reading); on the host this process's resident set (a host
    is shared with other processes, vLLM-CPU's reading)."""

    device: str  # "cpu" (host memory) or "cuda"
    total: int
    available: int
    used: int


@dataclass(frozen=True)
class KVBudget:
    """The pool's size and where it came from, for the start-up log and ``/get_server_info``."""

    source: str  # the flag that decided: max_total_tokens, kv_cache_memory_bytes, mem_fraction_static, default
    budget_bytes: int | None  # None when --max-total-tokens alone sized the pool
    bytes_per_token: int
    num_pages: int
    page_size: int
    memory: DeviceMemory | None = None  # what the device had, when a budget was measured against it
    # per-request records beside the pages (DeepSeek-V4's bounded layout), taken from the budget first
    record_bytes: int = 0

    @property
    def max_total_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def pool_bytes(self) -> int:
        return self.max_total_tokens * self.bytes_per_token

    def to_dict(self) -> dict:
        info: dict[str, Any] = {
            "source": self.source, "budget_bytes": self.budget_bytes, "bytes_per_token": self.bytes_per_token,
            "num_pages": self.num_pages, "page_size": self.page_size, "max_total_tokens": self.max_total_tokens,
            "pool_bytes": self.pool_bytes}
        if self.record_bytes:
            info["record_bytes"] = self.record_bytes
        if self.memory is not None:
            info["device_memory"] = {"device": self.memory.device, "total": self.memory.total,
                                     "available": self.memory.available, "used": self.memory.used}
        return info

    def describe(self) -> str:
        """One line for the start-up log."""
        pool = f"{self.num_pages} pages x {self.page_size} tokens = {self.max_total_tokens} tokens, " \
               f"{_gib(self.pool_bytes)} at {self.bytes_per_token} B/token"
        if self.record_bytes:
            pool += f" + {_gib(self.record_bytes)} of per-request records"
        if self.source == "max_total_tokens":
            return f"{pool} (--max-total-tokens)"
        if self.source == "mem_fraction_static" and self.memory is not None:
            m = self.memory
            return (f"{pool} (budget {_gib(self.budget_bytes or 0)} from --mem-fraction-static: {m.device} memory "
                    f"{_gib(m.total)} total, {_gib(m.available)} available, {_gib(m.used)} in use)")
        flag = "--kv-cache-memory-bytes" if self.source == "kv_cache_memory_bytes" else "the default budget"
        return f"{pool} (budget {_gib(self.budget_bytes or 0)} from {flag})"


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


def budget_bytes(kv_cache_memory_bytes: int | None, mem_fraction_static: float | None,
                 memory: DeviceMemory | None) -> tuple[str, int]:
    """(source, bytes) of the budget; ValueError naming the flag when it leaves nothing or more than
    the device has. ``memory`` is needed for ``mem_fraction_static``."""
    if kv_cache_memory_bytes is not None:
        source, budget = "kv_cache_memory_bytes", kv_cache_memory_bytes
    elif mem_fraction_static is not None:
        if memory is None:
            raise ValueError("mem_fraction_static: needs the device's memory, which was not measured")
        source, budget = "mem_fraction_static", int(mem_fraction_static * memory.total) - memory.used
        if budget <= 0:
            raise ValueError(f"mem_fraction_static: {mem_fraction_static} of {memory.device} memory "
                             f"({_gib(memory.total)}) leaves no KV pool: {_gib(memory.used)} is already in use; "
                             f"raise it, or give --kv-cache-memory-bytes or --max-total-tokens")
    else:
        source, budget = "default", DEFAULT_KV_CACHE_MEMORY_BYTES
    if memory is not None and budget > memory.available:
        raise ValueError(f"{source}: a KV pool of {_gib(budget)} is more than the {_gib(memory.available)} of "
                         f"{memory.device} memory available; lower it, or give --max-total-tokens")
    return source, budget


def size_pool(page_size: int, bytes_per_token: int, max_total_tokens: int | None,
              kv_cache_memory_bytes: int | None = None, mem_fraction_static: float | None = None,
              memory: DeviceMemory | None = None, record_bytes: int = 0) -> KVBudget:
    """The pool's pages: ``max_total_tokens`` alone sizes it exactly; a byte budget gives
    ``(budget - record_bytes) // bytes_per_token`` tokens (capped by ``max_total_tokens`` when both are
    given), at least one page. ``record_bytes``: per-request records allocated beside the pages."""
    if bytes_per_token < 1:
        raise ValueError(f"bytes_per_token: must be >= 1, got {bytes_per_token}")
    if max_total_tokens is not None and kv_cache_memory_bytes is None and mem_fraction_static is None:
        return KVBudget("max_total_tokens", None, bytes_per_token, max(1, max_total_tokens // page_size), page_size,
                        record_bytes=record_bytes)
    source, budget = budget_bytes(kv_cache_memory_bytes, mem_fraction_static, memory)
    if record_bytes >= budget:
        raise ValueError(f"{source}: the budget of {budget} B leaves nothing for pages after {record_bytes} B of "
                         f"per-request state records (lower --max-running-requests or raise the budget)")
    tokens = (budget - record_bytes) // bytes_per_token
    if max_total_tokens is not None:
        tokens = min(tokens, max_total_tokens)
    return KVBudget(source, budget, bytes_per_token, max(1, tokens // page_size), page_size, memory, record_bytes)


def host_memory() -> DeviceMemory:
    """The host's memory from /proc (Linux): MemTotal, MemAvailable, and this process's resident set."""
    fields = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, rest = line.partition(":")
            fields[key] = int(rest.split()[0]) * 1024  # kB
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return DeviceMemory("cpu", fields["MemTotal"], fields.get("MemAvailable", fields.get("MemFree", 0)), rss)


def cuda_memory(device) -> DeviceMemory:
    """The GPU's memory: everything in use on it counts (SGLang's reading of --mem-fraction-static)."""
    import torch

    free, total = torch.cuda.mem_get_info(device)
    return DeviceMemory("cuda", total, free, total - free)


def device_memory(device) -> DeviceMemory:
    """The memory of ``device`` (a torch.device): a GPU's own, else the host's."""
    return cuda_memory(device) if getattr(device, "type", str(device)) == "cuda" else host_memory()
