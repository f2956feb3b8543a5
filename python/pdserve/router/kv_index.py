"""Pure: one worker's cached blocks as its KV events describe them, and a prompt's block hashes.

The index applies numbered event batches in order. A batch that does not follow the last one
applied (``seq != last + 1``) is a gap: events were lost, the index no longer knows the worker's
cache, and ``apply`` refuses it so the caller resyncs from the worker's snapshot. Batches at or
below the snapshot's ``seq`` are already in it and are skipped.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.mem.radix_cache import hash_chain, key_check, salt_hash
from pdserve.obs.kv_events import MEDIUM_GPU

__all__ = ["KVIndex", "key_check", "prompt_block_hashes"]


def prompt_block_hashes(token_ids: Sequence[int], page_size: int, key: bytes = b"", salt: str = "") -> list[int]:
    """The chained hashes a server's radix cache gives the full pages of ``token_ids``, under the
    deployment's hash key (``--kv-hash-key-file``), in the tree of the request's ``cache_salt``. The
    last token is left out: a server never serves it from the cache (it must run to give logits)."""
    usable = max(0, len(token_ids) - 1)
    return hash_chain(salt_hash(salt, key), [token_ids[start:start + page_size]
                                             for start in range(0, usable - page_size + 1, page_size)], key)


class KVIndex:
    """Block hashes per medium, and the last batch applied (None: nothing known yet)."""

    def __init__(self) -> None:
        self.blocks: dict[str, set[int]] = {}
        self.seq: int | None = None

    @property
    def num_blocks(self) -> int:
        return len(self.blocks.get(MEDIUM_GPU, ()))

    def matched_blocks(self, hashes: Sequence[int], medium: str = MEDIUM_GPU) -> int:
        """How many leading blocks of ``hashes`` the worker holds (a chain: stop at the first miss)."""
        held = self.blocks.get(medium, set())
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n

    def follows(self, seq: int) -> bool | None:
        """True: batch ``seq`` is the next one; None: already applied (skip it); False: a gap."""
        if self.seq is not None and seq <= self.seq:
            return None
        return self.seq is not None and seq == self.seq + 1

    def apply(self, seq: int, events: Sequence[dict]) -> bool:
        """Apply batch ``seq``; False (nothing changed) on a gap. Raises ValueError on a malformed event."""
        follows = self.follows(seq)
        if follows is None:
            return True
        if not follows:
            return False
        for event in events:
            self._apply_one(event)
        self.seq = seq
        return True

    def load_snapshot(self, snapshot: dict) -> None:
        """Replace everything with a worker's ``/kv_events/snapshot`` answer."""
        blocks: dict[str, set[int]] = {}
        for b in snapshot["blocks"]:
            blocks.setdefault(str(b.get("medium", MEDIUM_GPU)), set()).add(int(b["block_hash"]))
        self.blocks = blocks
        self.seq = int(snapshot["seq"])

    def forget(self) -> None:
        """Know nothing (the worker is gone or silent)."""
        self.blocks, self.seq = {}, None

    def _apply_one(self, event: dict) -> None:
        kind = event.get("type")
        medium = str(event.get("medium") or MEDIUM_GPU)
        if kind == "BlockStored":
            self.blocks.setdefault(medium, set()).update(int(h) for h in event["block_hashes"])
        elif kind == "BlockRemoved":
            self.blocks.get(medium, set()).difference_update(int(h) for h in event["block_hashes"])
        elif kind == "AllBlocksCleared":
            if event.get("medium") is None:
                self.blocks = {}
            else:
                self.blocks.pop(medium, None)
        else:
            raise ValueError(f"KV event: unknown type {kind!r}")
