"""codec.py: every message that travels between a server's processes and ranks round-trips;
anything else (an unknown type, a field of the wrong type, an oversize frame, a pickle) is a
CodecError, a receiving loop drops it and goes on; and nothing in python/pdserve pickles."""

from __future__ import annotations

import ast
import math
import os
import pickle
from pathlib import Path

import msgspec
import pytest
import zmq

from disagg.test_bootstrap import COMPAT, rank_record
from disagg.test_protocol import MESSAGES as PROTOCOL_SAMPLES
from pdserve.disagg.bootstrap import BootstrapInfo
from pdserve.disagg.receiver import Peer, PeerFetched, PeersDead, PeersGone
from pdserve.disagg.roles import MESSAGE_TYPES
from pdserve.engine.codec import Codec, CodecError, DropCounter, Values
from pdserve.engine.io_struct import (
    AbortReq,
    BatchTokenOutput,
    BootstrapRef,
    FlushCacheReq,
    FlushCacheResp,
    GetStatsReq,
    KVEventsSnapshotReq,
    KVEventsSnapshotResp,
    PrefillLostReq,
    RejectedReq,
    RoleSwitchReq,
    RoleSwitchResp,
    SchedulerFailed,
    SchedulerReady,
    ShutdownReq,
    StatsResp,
    TokenizedGenerateReq,
    TokenOutput,
)
from pdserve.engine.rank_io import CheckMemoryReq, CheckMemoryResp, RankMemory
from pdserve.engine.request import SamplingParams
from pdserve.engine.sampler import SampleResult
from pdserve.engine.scheduler_loop import FRONTEND_CODEC, SchedulerLoop

PACKAGE = Path(__file__).resolve().parents[2] / "python" / "pdserve"
# What a multi-rank scheduler's exchange carries: the frontend's messages and its mode's.
RANK_CODEC = FRONTEND_CODEC.with_types(MESSAGE_TYPES)

SAMPLING = SamplingParams(max_new_tokens=7, temperature=0.5, top_k=20, top_p=0.9, seed=3, stop=["\n\n"],
                          stop_token_ids=[2], ignore_eos=True, n=2)
OUTPUT = TokenOutput("r1", [5, 6], [-0.5, -math.inf], True, {"type": "stop", "matched": 2}, 4, 2, 1,
                     new_top_logprobs=[[(-0.5, 5), (-1.5, 9)], [(-math.inf, 6)]],
                     input_token_logprobs=[None, -2.0], input_top_logprobs=[None, [(-2.0, 7)]],
                     timeline={"queue": 0.01, "prefill": 0.2}, cached_tokens_by_tier={"device": 1})
PEER = Peer(("10.0.0.5", 8998), BootstrapInfo(COMPAT, [rank_record(0), rank_record(1)]))

SAMPLES = [
    TokenizedGenerateReq("r1", [1, 2, 3], SAMPLING, True, 0, 2, BootstrapRef("10.0.0.5", 8998, 2**63 - 1)),
    TokenizedGenerateReq("r2", [9], SamplingParams()),
    TokenizedGenerateReq("r3", [9], SamplingParams(json_schema='{"type": "object"}')),
    TokenizedGenerateReq("r4", [9], SamplingParams(regex="[ab]+")),
    TokenizedGenerateReq("r5", [9], SamplingParams(ebnf='root ::= "x"')),
    AbortReq("r1"), AbortReq("", abort_all=True), FlushCacheReq(), FlushCacheResp(True), GetStatsReq(),
    KVEventsSnapshotReq(), KVEventsSnapshotResp({"seq": 3, "blocks": [[1, 2], [3]]}), KVEventsSnapshotResp(None),
    StatsResp({"num_running_reqs": 1, "token_usage": 0.25, "dp_ranks": [{"free_pages": 3}]}),
    RejectedReq("r1", "input_ids: empty"),
    BatchTokenOutput([OUTPUT, TokenOutput("r2", [], None, False, None, 1, 0, 0)]),
    SchedulerReady(123, 4096, 32000, 256, 16), SchedulerFailed("rank 1: ValueError: x"), ShutdownReq(),
    RoleSwitchReq("decode"), RoleSwitchResp(False, "prefill", "busy", busy=True),
    PrefillLostReq([1, 2**63 - 1], "the router saw prefill's half break"),
    CheckMemoryReq(), CheckMemoryResp([RankMemory(0, 0, 10, 5, 5, False), RankMemory(1, 0, 10, 4, 5, True, "leak")]),
    *PROTOCOL_SAMPLES,
    PeerFetched(PEER), PeerFetched(Peer(("10.0.0.6", 8998), error="unreachable", retry_at=3.5)),
    PeersDead(frozenset({"10.0.0.5:15000"})), PeersGone(frozenset()),
]


def test_every_registered_type_has_a_sample():
    """A new message type must join SAMPLES, so its round trip is tested."""
    assert {type(m).__name__ for m in SAMPLES} == set(RANK_CODEC.types)


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    assert RANK_CODEC.decode(RANK_CODEC.encode(msg)) == msg
    if type(msg).__name__ in FRONTEND_CODEC.types:
        assert FRONTEND_CODEC.decode(FRONTEND_CODEC.encode(msg)) == msg


def test_types_come_back_as_declared():
    got = FRONTEND_CODEC.decode(FRONTEND_CODEC.encode(BatchTokenOutput([OUTPUT])))
    assert isinstance(got.outputs[0], TokenOutput) and got.outputs[0].new_top_logprobs[0][0] == (-0.5, 5)
    req = FRONTEND_CODEC.decode(FRONTEND_CODEC.encode(SAMPLES[0]))
    assert isinstance(req.sampling, SamplingParams) and isinstance(req.bootstrap, BootstrapRef)


def _frame(name: str, fields) -> bytes:
    return msgspec.msgpack.encode((name, fields))


class Evil:
    def __reduce__(self):
        return (os.system, ("true",))


@pytest.mark.parametrize("frame, says", [
    (_frame("Popen", {"args": ["sh"]}), "type: unknown message type 'Popen'"),
    (_frame("TokenOutput", {}), "unknown message type 'TokenOutput'"),  # nested only: not a message
    (_frame("AbortReq", {"rid": 5}), "AbortReq: Expected `str`, got `int` - at `$.rid`"),
    (_frame("TokenizedGenerateReq", {"rid": "r", "input_ids": [1, "2"], "sampling": {}}), "$.input_ids[1]"),
    (_frame("TokenizedGenerateReq", {"rid": "r", "input_ids": [1], "sampling": {"temperature": "hot"}}),
     "$.sampling.temperature"),
    (_frame("TokenizedGenerateReq", {"rid": "r", "input_ids": [1]}), "missing required field `sampling`"),
    (_frame("BatchTokenOutput", {"outputs": [{"rid": "r"}]}), "$.outputs[0]"),
    (_frame("FlushCacheResp", {"success": 1}), "Expected `bool`"),
    (msgspec.msgpack.encode(["AbortReq"]), "frame: not a [type, fields] message"),
    (msgspec.msgpack.encode({"type": "AbortReq"}), "frame: not a [type, fields] message"),
    (pickle.dumps(Evil()), "frame: not a [type, fields] message"),
    (pickle.dumps(AbortReq("r1")), "frame: not a [type, fields] message"),
    (b"\x91" * 100_000 + b"\xc0", "frame: not a [type, fields] message"),  # nested beyond the recursion limit
    (b"", "frame: not a [type, fields] message"),
], ids=lambda v: None if isinstance(v, str) else "")
def test_anything_else_is_a_codec_error_that_says_why(frame, says):
    with pytest.raises(CodecError) as e:
        RANK_CODEC.decode(frame)
    assert says in str(e.value)


def test_a_frame_over_the_bound_is_refused_before_decoding():
    codec = Codec(FRONTEND_CODEC.types.values(), max_bytes=64)
    big = codec.encode(AbortReq("x" * 100))
    with pytest.raises(CodecError, match=f"frame: {len(big)} bytes \\(at most 64\\)"):
        codec.decode(big)
    assert codec.decode(codec.encode(AbortReq("x"))) == AbortReq("x")


def test_only_registered_types_are_encoded_and_names_are_unique():
    with pytest.raises(CodecError, match="type: Evil is not a message this codec carries"):
        FRONTEND_CODEC.encode(Evil())
    with pytest.raises(CodecError, match="type: PeersDead"):
        FRONTEND_CODEC.encode(PeersDead(frozenset()))  # the rank loop's codec carries it, not the frontend's

    class AbortReq:  # noqa: F811 - a second type under a registered name
        rid: str

    with pytest.raises(ValueError, match="two message types named AbortReq"):
        FRONTEND_CODEC.with_types([AbortReq])


def test_values_for_collectives_keep_their_shape_or_their_declared_type():
    values = Values()
    facts = {2**63 - 1: None, 5: "", 7: "a KV write failed"}  # a prefill rank's drained rooms (int keys)
    assert values.decode(values.encode(facts)) == facts
    assert values.decode(values.encode(b"\x00salt")) == b"\x00salt"
    assert values.decode(values.encode([("10.0.0.5", 8998)])) == [["10.0.0.5", 8998]]  # tuples: lists
    mem = RankMemory(1, 0, 10, 4, 5, True)
    assert values.decode(values.encode(mem), RankMemory) == mem
    res = SampleResult([3, 4], [-0.1, -0.2], [[(-0.1, 3)], []])
    assert values.decode(values.encode(res), SampleResult) == res
    with pytest.raises(CodecError, match="value: not a RankMemory"):
        values.decode(values.encode({"rank": "0"}), RankMemory)
    with pytest.raises(CodecError, match="value: Evil cannot be sent"):
        values.encode(Evil())


def test_a_scheduler_loop_drops_junk_and_goes_on(caplog):
    """A pickle, a stranger's type and a malformed request are dropped (counted, logged at the first
    and each power of two); the valid message behind them is handled."""
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    try:
        pull.bind("inproc://codec-loop")
        push.connect("inproc://codec-loop")
        for frame in (pickle.dumps(Evil()), _frame("Popen", {}), _frame("AbortReq", {"rid": 1}),
                      FRONTEND_CODEC.encode(ShutdownReq())):
            push.send(frame)
        loop = SchedulerLoop(None, pull, push)  # the scheduler is not reached: only a ShutdownReq is handled
        with caplog.at_level("WARNING"):
            loop.drain(block=False)
        assert loop.stopped and loop.drops.count == 3
        assert [r.getMessage().split(" (")[0] for r in caplog.records] == [
            "scheduler: dropped a frame that is not one of our messages"] * 2  # the 1st and the 2nd
    finally:
        pull.close(linger=0)
        push.close(linger=0)
        ctx.term()


def test_drop_counter_logs_powers_of_two(caplog):
    drops = DropCounter("frontend")
    with caplog.at_level("WARNING"):
        for _ in range(9):
            drops.record(CodecError("x"))
    assert drops.count == 9 and len(caplog.records) == 4  # 1, 2, 4, 8


# Anything that turns bytes from a socket, a file or a collective into objects by running code.
PICKLING_MODULES = {"pickle", "_pickle", "cPickle", "cloudpickle", "dill", "marshal", "shelve", "joblib"}
PICKLING_CALLS = {"send_pyobj", "recv_pyobj", "send_serialized", "recv_serialized", "all_gather_object",
                  "broadcast_object_list", "gather_object", "scatter_object_list", "send_object_list",
                  "recv_object_list"}


def pickling_uses(source: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] in PICKLING_MODULES]
        elif isinstance(node, ast.ImportFrom):
            if (node.module or "").split(".")[0] in PICKLING_MODULES:
                found.append(node.module or "")
            found += [a.name for a in node.names if a.name in PICKLING_CALLS]
        elif isinstance(node, ast.Attribute) and node.attr in PICKLING_CALLS:
            found.append(node.attr)
        elif isinstance(node, ast.Name) and node.id in PICKLING_CALLS:
            found.append(node.id)
    return found


def test_nothing_in_the_package_pickles():
    uses = {str(p.relative_to(PACKAGE)): pickling_uses(p.read_text()) for p in sorted(PACKAGE.rglob("*.py"))}
    assert {p: u for p, u in uses.items() if u} == {}


def test_the_scan_sees_each_way_in():
    source = ("import pickle\nfrom cloudpickle import loads\nimport zmq\ns.recv_pyobj()\n"
              "dist.broadcast_object_list(box)\nfrom torch.distributed import all_gather_object\n")
    assert sorted(pickling_uses(source)) == ["all_gather_object", "broadcast_object_list", "cloudpickle", "pickle",
                                             "recv_pyobj"]
