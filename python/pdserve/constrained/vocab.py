"""The bytes each token id stands for (what regex-automaton backends match against).

Byte-level BPE tokenizers (GPT-2, Llama-3, Qwen, DeepSeek-V3) spell every byte as one printable
character; SentencePiece-style ones write a space as ``▁`` and raw bytes as ``<0xAB>``.
"""

from __future__ import annotations

import json
import re
from typing import Any

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _byte_level_alphabet() -> dict[str, int]:
    """character -> byte of the byte-level BPE spelling: printable Latin-1 bytes stand for
    themselves, the other 68 are shifted to code points 256 and up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + shifted)
            shifted += 1
    return {c: b for b, c in chars.items()}


def is_byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    return any(p.get("type") == "ByteLevel" for p in parts)


def token_bytes(tokenizer: Any) -> dict[int, bytes]:
    """Every non-special token id -> its bytes (special tokens such as EOS are not text)."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    special |= {i for i, t in added.items() if getattr(t, "special", False)}
    alphabet = _byte_level_alphabet() if is_byte_level(tokenizer) else None
    out: dict[int, bytes] = {}
    for piece, i in tokenizer.get_vocab().items():
        if i in special:
            continue
        if alphabet is not None:
            if all(c in alphabet for c in piece):
                out[i] = bytes(alphabet[c] for c in piece)
            else:  # an added (non-special) token written as plain text
                out[i] = piece.encode()
            continue
        m = _BYTE_TOKEN.match(piece)
        out[i] = bytes([int(m.group(1), 16)]) if m else piece.replace("▁", " ").encode()
    return out
