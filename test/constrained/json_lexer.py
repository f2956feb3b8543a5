"""The oracle of the strict-JSON property test (test_json_strings.py) and of the fuzz: a byte-level
lexer of JSON text (the state after each byte, or BAD where RFC 8259 cannot have it) and the
compact-spacing check, written apart from every backend."""

from __future__ import annotations

import numpy as np

from constrained.grammar_fixtures import VOCAB
from pdserve.constrained.vocab import UTF8_BAD, UTF8_STATES, utf8_run

# lexer states of a JSON text: outside strings, inside one, after a backslash, inside \uXXXX (4..1 left)
OUT, IN, ESC, HEX4, HEX3, HEX2, HEX1 = range(7)
STATES = 7
BAD = -1
JSON_CHARS = set(b"{}[],:-+.0123456789eEtrufalsn")  # every byte JSON may have outside a string but whitespace
ANY_WS = set(b" \t\n\r")
HEXDIGITS = set(b"0123456789abcdefABCDEF")


def step(state: int, byte: int, whitespace: set[int]) -> int:
    """The lexer state after ``byte``; BAD where strict JSON cannot have it."""
    if state == OUT:
        return IN if byte == ord('"') else OUT if byte in JSON_CHARS or byte in whitespace else BAD
    if state == IN:
        return OUT if byte == ord('"') else ESC if byte == ord("\\") else BAD if byte < 0x20 else IN
    if state == ESC:
        return HEX4 if byte == ord("u") else IN if byte in b'"\\/bfnrt' else BAD
    return (IN if state == HEX1 else state + 1) if byte in HEXDIGITS else BAD


def run(state: int, data: bytes, whitespace: set[int]) -> int:
    for byte in data:
        state = step(state, byte, whitespace)
        if state == BAD:
            return BAD
    return state


def transitions(table: dict[int, bytes], whitespace: set[int]) -> np.ndarray:
    """[STATES, VOCAB]: the state after each token from each state (BAD: invalid there; specials,
    which are not text, are left BAD and checked apart)."""
    out = np.full((STATES, VOCAB), BAD, dtype=np.int8)
    for t, data in table.items():
        for s in range(STATES):
            out[s, t] = run(s, data, whitespace)
    return out


def utf8_transitions(table: dict[int, bytes]) -> np.ndarray:
    """[UTF-8 states, VOCAB]: the UTF-8 automaton's state after each text token (UTF8_BAD: no valid
    UTF-8 text continues so: a surrogate, an overlong form, a stray continuation byte)."""
    out = np.full((len(UTF8_STATES), VOCAB), UTF8_BAD, dtype=np.int8)
    for t, data in table.items():
        for s in range(len(UTF8_STATES)):
            out[s, t] = utf8_run(s, data)
    return out


def compact_spacing(text: str) -> bool:
    """Outside strings, whitespace is at most one space, right after ':' or ','."""
    state, prev = OUT, ""
    for ch in text:
        if state == OUT and ch in " \t\n\r" and not (ch == " " and prev in ":,"):
            return False
        state = run(state, ch.encode(), ANY_WS)
        prev = ch
    return True
