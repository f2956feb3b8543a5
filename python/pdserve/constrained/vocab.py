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


# UTF-8 as a byte automaton (RFC 3629 table 4): the state says what the next byte may be. ANY: at a
# character boundary; CONT1..3: that many continuation bytes (80-BF) still owed; the others owe
# more, the first of them from a narrower range (no overlong forms, no surrogates D800-DFFF, nothing
# past U+10FFFF).
UTF8_STATES = ("ANY", "CONT1", "CONT2", "CONT3", "E0", "ED", "F0", "F4")
ANY, CONT1, CONT2, CONT3, AFTER_E0, AFTER_ED, AFTER_F0, AFTER_F4 = range(len(UTF8_STATES))
UTF8_BAD = -1
_FIRST_CONT = {CONT1: (0x80, 0xBF, ANY), CONT2: (0x80, 0xBF, CONT1), CONT3: (0x80, 0xBF, CONT2),
               AFTER_E0: (0xA0, 0xBF, CONT1), AFTER_ED: (0x80, 0x9F, CONT1),
               AFTER_F0: (0x90, 0xBF, CONT2), AFTER_F4: (0x80, 0x8F, CONT2)}


def utf8_step(state: int, byte: int) -> int:
    """The state after ``byte``; UTF8_BAD where no valid UTF-8 text continues so."""
    if state != ANY:
        low, high, then = _FIRST_CONT[state]
        return then if low <= byte <= high else UTF8_BAD
    if byte < 0x80:
        return ANY
    if 0xC2 <= byte <= 0xDF:
        return CONT1
    if byte in (0xE0, 0xED):
        return AFTER_E0 if byte == 0xE0 else AFTER_ED
    if 0xE1 <= byte <= 0xEF:
        return CONT2
    if byte in (0xF0, 0xF4):
        return AFTER_F0 if byte == 0xF0 else AFTER_F4
    return CONT3 if 0xF1 <= byte <= 0xF3 else UTF8_BAD


def utf8_run(state: int, data: bytes) -> int:
    for byte in data:
        state = utf8_step(state, byte)
        if state == UTF8_BAD:
            break
    return state
