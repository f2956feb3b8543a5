"""Pure rewriting of a generation request body for P/D: add ``bootstrap_host``,
``bootstrap_port`` and ``bootstrap_room`` (SGLang's wire format).

A batch body (several prompts) gets one room per prompt, and host and port
repeated per prompt, as lists of the batch's length, as sglang-router does.
Rooms are random 63-bit integers (``0 <= room < 2**63``), so they fit a signed
64-bit field anywhere they travel.
"""

from __future__ import annotations

import ipaddress
import random
from urllib.parse import urlsplit

ROOM_BITS = 63


def bootstrap_host(url: str) -> str:
    """The host part of a worker URL as a peer would put it in a URL (IPv6 in brackets)."""
    host = urlsplit(url).hostname
    if host is None:
        raise ValueError(f"worker url: no host in {url!r}")
    try:
        return f"[{host}]" if isinstance(ipaddress.ip_address(host), ipaddress.IPv6Address) else host
    except ValueError:  # a DNS name
        return host


def batch_size(body: dict) -> int | None:
    """Number of prompts in a batch body, or None for a single request.

    Batches: ``/generate`` with ``text`` a list or ``input_ids`` a list of lists;
    ``/v1/completions`` with ``prompt`` a list of strings or of token lists (a flat
    list of ints is one tokenized prompt). An empty list counts as a single request:
    the worker rejects it with its own error. ``n`` is not a batch (pdserve takes n=1).
    """
    for field in ("text", "input_ids", "prompt"):
        value = body.get(field)
        if isinstance(value, list) and value and not isinstance(value[0], int):
            return len(value)
    return None


def new_room(rng: random.Random) -> int:
    return rng.getrandbits(ROOM_BITS)


def with_bootstrap(body: dict, host: str, port: int, rng: random.Random) -> dict:
    """A copy of ``body`` with the bootstrap fields of one prefill worker added (replacing any sent)."""
    n = batch_size(body)
    if n is None:
        fields = {"bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": new_room(rng)}
    else:
        fields = {"bootstrap_host": [host] * n, "bootstrap_port": [port] * n,
                  "bootstrap_room": [new_room(rng) for _ in range(n)]}
    return {**body, **fields}
