"""hypothesis against the bootstrap registry's HTTP handler, over real HTTP on loopback: whatever
a peer PUTs, the answer is 200 or a clean 4xx with a JSON body (never a dropped connection, a 5xx
or a hang), the registry goes on serving, and what it answers stays small.

Bounded for CI: a few dozen requests per property on one server per module.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import string
import sys

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from pdserve.disagg.bootstrap import BootstrapServer, CompatRecord, RankRecord
from pdserve.disagg.layout import KVLayout
from pdserve.transfer.base import BufferDescriptor

FUZZ = settings(max_examples=30, deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
FUZZ_KNOWN = settings(FUZZ, max_examples=20, phases=(Phase.explicit, Phase.generate))  # no shrinking
TIMEOUT_S = 5.0  # an answer later than this is a hang
MAX_SNAPSHOT_BYTES = 1 << 20  # GET /bootstrap for any accepted record stays under this

COMPAT = CompatRecord("tiny-llama", "LlamaForCausalLM", "bfloat16", 16, "gqa-hnd", 4, 8, 64, "ab" * 32)
LAYOUT = KVLayout("gqa", 2, 8, 16, "bfloat16", 4, 100, 4 * 16 * 128, 100 * 4 * 16 * 128)
RECORDS = {"/bootstrap/compat": COMPAT}


def rank_record(rank: int = 0, layout: KVLayout = LAYOUT) -> RankRecord:
    bufs = [BufferDescriptor(name, 0x7F0000000000 + i * (1 << 30), layout.page_bytes, layout.layer_stride,
                             layout.num_layers, layout.num_pages) for i, name in enumerate(layout.buffers)]
    return RankRecord(rank, "127.0.0.1:15000", bufs, "tcp://127.0.0.1:6000", layout)


RECORDS["/bootstrap/rank"] = rank_record()


@pytest.fixture(scope="module")
def registry():
    with BootstrapServer("127.0.0.1", 0) as s:
        yield s


def request(server: BootstrapServer, method: str, path: str, body: bytes | None = None,
            headers: dict | None = None, timeout: float = TIMEOUT_S) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(server.host, server.port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def answers_cleanly(server: BootstrapServer, path: str, body: bytes, headers: dict | None = None,
                    timeout: float = TIMEOUT_S) -> None:
    """The property: 200, 400, 404 or 409 with a JSON body; then the registry still serves."""
    status, data = request(server, "PUT", path, body, headers, timeout)
    assert status in (200, 400, 404, 409, 413), (status, data)
    json.loads(data)
    assert request(server, "GET", "/health")[0] == 200


# --- strategies ---------------------------------------------------------------------------------

edge_ints = st.sampled_from([0, -1, 1, 2**63, 2**64, -(2**63) - 1])
scalars = st.none() | st.booleans() | st.integers() | edge_ints | st.floats() | st.text(max_size=20)
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
paths = st.sampled_from(sorted(RECORDS))


def _paths(obj, prefix=()) -> list[tuple]:
    out = []
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else []
    for k, v in items:
        out.append((*prefix, k))
        out += _paths(v, (*prefix, k))
    return out


@st.composite
def mutated_records(draw, values=json_values) -> tuple[str, bytes]:
    """A valid record of a route with one value (anywhere in it) replaced by ``values``."""
    path = draw(paths)
    body = dataclasses.asdict(RECORDS[path])
    where = draw(st.sampled_from(_paths(body)))
    target = body
    for key in where[:-1]:
        target = target[key]
    target[where[-1]] = draw(values)
    return path, json.dumps(body).encode()


# --- properties that hold today -----------------------------------------------------------------


@FUZZ
@given(paths, st.binary(max_size=256))
def test_any_bytes(registry, path, body):
    answers_cleanly(registry, path, body)


@FUZZ
@given(paths, json_values)
def test_any_json_value(registry, path, value):
    answers_cleanly(registry, path, json.dumps(value).encode())


@FUZZ
@given(mutated_records())
def test_one_field_of_a_valid_record_replaced(registry, case):
    answers_cleanly(registry, *case)


@FUZZ
@given(st.text(alphabet=string.ascii_letters + string.digits + "/-_.?=&%", max_size=30).map("/{}".format))
def test_unknown_paths_are_404(registry, path):
    status, data = request(registry, "GET", path)
    assert status in (200, 404) and json.loads(data) is not None


def test_valid_records_are_accepted(registry):
    for path, record in RECORDS.items():
        assert request(registry, "PUT", path, json.dumps(dataclasses.asdict(record)).encode())[0] == 200


# --- properties today's handler breaks ---------------------------------------------------------


@FUZZ_KNOWN
@given(paths, st.integers(sys.getrecursionlimit(), 50 * sys.getrecursionlimit()))
def test_deep_nesting(registry, path, depth):
    """RecursionError in json.loads escapes ``do_PUT`` (it catches ValueError only): http.server
    drops the connection without an answer."""
    answers_cleanly(registry, path, ("[" * depth + "]" * depth).encode())


@FUZZ_KNOWN
@given(st.sampled_from(["-1", "x", "99999999999999999999", "1e3"]))
def test_bad_content_length(registry, declared):
    """``Content-Length: -1`` makes the handler read to EOF (the client waits for an answer: a
    hang); a non-number is a ValueError (400, fine); an overlong one waits for bytes never sent."""
    answers_cleanly(registry, "/bootstrap/compat", b"{}", {"Content-Length": declared}, timeout=2.0)


@FUZZ_KNOWN
@given(st.sampled_from([1 << 17, 1 << 20]))
def test_snapshot_stays_small(registry, dp_size):
    """A PUT with a huge ``dp_size`` is accepted and makes every GET /bootstrap list that many
    missing ranks (26 MB in the issue's run)."""
    record = dataclasses.asdict(rank_record(0))
    record["layout"]["dp_size"] = dp_size  # a layout KVLayout itself would refuse to build
    status, _ = request(registry, "PUT", "/bootstrap/rank", json.dumps(record).encode())
    if status == 200:
        status, data = request(registry, "GET", "/bootstrap")
        assert status == 200 and len(data) <= MAX_SNAPSHOT_BYTES, len(data)
