"""The TransferBackend contract, on every backend: the real Mooncake engine and NIXL (TCP,
127.0.0.1, receiver in another process) and the in-memory one (receiver on a thread).

The two ordering tests are the evidence behind transfer/base.py's docstring: DONE means the
bytes landed, and a notify never overtakes its data.
"""

from __future__ import annotations

import json
import os
import random
import socket
import sys
import threading

import pytest
import torch
from transfer_peer import Peer, alloc

from pdserve.transfer import (
    FaultInjectingBackend,
    MooncakeTransferBackend,
    Outstanding,
    TransferError,
    WriteState,
    check_writes,
    create_transfer_backend,
    import_mooncake,
    import_nixl,
    merge_contiguous,
    mooncake_available,
    nixl_available,
)
from pdserve.transfer.faults import _LATE, FAULTS_ENV, with_faults

needs_mooncake = pytest.mark.skipif(
    not mooncake_available(),
    reason="mooncake cannot be imported: pip install -e '.[cpu]' (and apt libibverbs1 libnuma1)")

BUF = 8 << 20
WAIT_S = 60
needs_nixl = pytest.mark.skipif(not nixl_available(), reason="nixl cannot be imported: pip install -e '.[nixl]'")
BACKENDS = [pytest.param("mooncake", marks=needs_mooncake), pytest.param("nixl", marks=needs_nixl), "memory"]
# Rounds of the ordering tests: Mooncake's races show within hundreds; the in-memory backend
# copies under the receiver's lock before DONE, so a few rounds check the wiring.
ROUNDS = {"mooncake": 300, "nixl": 300, "memory": 30}


# --- pure helpers -----------------------------------------------------------------------------


def test_merge_contiguous_needs_both_sides_contiguous():
    srcs = [0, 10, 20, 40, 50]
    dsts = [100, 110, 130, 140, 150]  # 10->20 breaks on dst, 20->40 breaks on src
    lens = [10, 10, 10, 10, 5]
    assert merge_contiguous(srcs, dsts, lens) == ([0, 20, 40], [100, 130, 140], [20, 10, 15])
    assert merge_contiguous([], [], []) == ([], [], [])


@pytest.mark.parametrize("srcs,dsts,lens,field", [
    ([1, 2], [1], [1, 1], "lengths differ"),
    ([], [], [], "at least one write"),
    ([1], [1], [0], "lens[0]"),
])
def test_check_writes_names_the_problem(srcs, dsts, lens, field):
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        check_writes(srcs, dsts, lens)


def test_unknown_backend_and_protocol_are_refused():
    with pytest.raises(ValueError, match="disaggregation_transfer_backend"):
        create_transfer_backend("nccl")
    with pytest.raises(ValueError, match="protocol"):
        MooncakeTransferBackend(protocol="udp")


def test_missing_mooncake_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "mooncake", None)
    with pytest.raises(TransferError, match=r"pdserve\[cpu\].*pdserve\[cuda\].*libibverbs1"):
        import_mooncake()


def test_missing_nixl_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "nixl_cu12", None)
    with pytest.raises(TransferError, match=r"pdserve\[nixl\].*nixl-cu12"):
        import_nixl()


# --- one receiver process for the module --------------------------------------------------------


@pytest.fixture(scope="module", params=BACKENDS)
def backend_name(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def peer(backend_name):
    p = Peer(BUF, backend_name)
    yield p
    p.stop()


@pytest.fixture(scope="module")
def sender(backend_name, peer):
    be = create_transfer_backend(backend_name)
    src = alloc(BUF)
    be.register([(src.data_ptr(), BUF)])
    peer.link(be)
    yield be, src
    be.close()


def _split(rng: random.Random, size: int) -> list[int]:
    """1-4 cut points turning [0, size) into consecutive pieces (later merged or not)."""
    cuts = sorted(rng.sample(range(1, size), min(rng.randint(0, 3), size - 1))) if size > 1 else []
    return [0, *cuts, size]


def _random_region(rng: random.Random) -> tuple[int, int]:
    size = rng.choice([rng.randint(1, 4096), rng.randint(4096, 1 << 20), rng.randint(1 << 20, 6 << 20)])
    return rng.randint(0, BUF - size), size


def test_done_means_bytes_landed(backend_name, peer, sender):
    """Sender polls DONE, then at once asks the receiver (over a pipe) to check the bytes."""
    be, src = sender
    rng = random.Random(0)
    torn = []
    for rnd in range(ROUNDS[backend_name]):
        off, size = _random_region(rng)
        val = rnd % 255 + 1
        src[off:off + size] = val
        bounds = _split(rng, size)
        # Pieces listed last-first, so they stay separate writes instead of merging into one.
        pieces = list(zip(bounds, bounds[1:]))[::-1]
        h = be.post_writes(peer.session, [src.data_ptr() + off + a for a, _ in pieces],
                           [peer.base + off + a for a, _ in pieces], [b - a for a, b in pieces])
        assert h.num_writes == len(pieces)
        assert be.wait(h, WAIT_S) is WriteState.DONE, h.error
        if bad := peer.call("mismatches", off, size, val):
            torn.append((rnd, size, bad))
    assert torn == []


def test_notify_never_overtakes_its_data(backend_name, peer, sender):
    """The receiver checks the region a notify names as soon as the notify is visible."""
    be, src = sender
    rng = random.Random(1)
    torn = []
    for rnd in range(ROUNDS[backend_name] * 2 // 3):
        off, size = _random_region(rng)
        val = rnd % 255 + 1
        src[off:off + size] = val
        peer.conn.send(("check_on_notify",))  # the child spins on notifies() from now on
        be.write_sync(peer.session, [src.data_ptr() + off], [peer.base + off], [size],
                      notify=(f"room-{rnd}", f"{off},{size},{val}"))
        name, bad = peer.conn.recv()
        assert name == f"room-{rnd}"
        if bad:
            torn.append((rnd, size, bad))
    assert torn == []


def test_a_write_to_a_stopped_peer_is_not_done_until_it_runs(peer, sender):
    """DONE means landed: while the receiver's process is stopped nothing can land, so however
    long the sender polls the batch stays PENDING; once it runs again the batch turns DONE with
    its bytes."""
    be, src = sender
    src[:4096] = 8
    peer.freeze()
    try:
        h = be.post_writes(peer.session, [src.data_ptr()], [peer.base], [4096])
        assert be.wait(h, 0.5) is WriteState.PENDING
    finally:
        peer.thaw()
    assert be.wait(h, WAIT_S) is WriteState.DONE, h.error
    assert peer.call("mismatches", 0, 4096, 8) == 0


def test_pieces_land_and_contiguous_runs_merge(peer, sender):
    be, src = sender
    src[:1 << 20] = torch.arange(1 << 20, dtype=torch.int64).remainder(251).to(torch.uint8)
    # Pieces 0-1 contiguous on both sides (one write); piece 2 skips on the destination.
    srcs = [src.data_ptr(), src.data_ptr() + 100, src.data_ptr() + 200]
    dsts = [peer.base, peer.base + 100, peer.base + 5000]
    h = be.post_writes(peer.session, srcs, dsts, [100, 100, 300])
    assert h.num_writes == 2 and h.nbytes == 500
    assert be.wait(h, WAIT_S) is WriteState.DONE
    assert peer.call("bytes", 0, 200) == bytes(src[:200].numpy())
    assert peer.call("bytes", 5000, 300) == bytes(src[200:500].numpy())


def test_thousands_of_writes_to_one_peer_all_land(peer, sender):
    """Mooncake alone fails most writes past ~1,000 queued per peer; the backend's cap must not."""
    be, src = sender
    n, size = 3000, 1024
    src[:2 * n * size] = torch.arange(2 * n * size, dtype=torch.int64).remainder(253).to(torch.uint8)
    # Every other source block: nothing merges, 3000 real writes.
    h = be.post_writes(peer.session, [src.data_ptr() + 2 * i * size for i in range(n)],
                       [peer.base + i * size for i in range(n)], [size] * n)
    assert h.num_writes == n
    assert be.wait(h, WAIT_S) is WriteState.DONE, h.error
    got = peer.call("bytes", 0, n * size)
    want = src[:2 * n * size].view(n, 2, size)[:, 0].contiguous().numpy().tobytes()
    assert got == want


def test_concurrent_posts_sync_writes_and_notifies(peer, sender):
    be, src = sender
    chunk = 64 << 10
    src[:64 * chunk] = torch.arange(64 * chunk, dtype=torch.int64).remainder(241).to(torch.uint8)
    errors = []

    def poster(t: int) -> None:
        for i in range(t, 48, 4):  # 4 threads x 12 batches, disjoint regions
            h = be.post_writes(peer.session, [src.data_ptr() + i * chunk], [peer.base + i * chunk], [chunk])
            if be.wait(h, WAIT_S) is not WriteState.DONE:
                errors.append((i, h.error))

    threads = [threading.Thread(target=poster, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for i in range(48, 64):  # meanwhile: synchronous writes with notifies from this thread
        be.write_sync(peer.session, [src.data_ptr() + i * chunk], [peer.base + i * chunk], [chunk],
                      notify=("sync", str(i)))
    for t in threads:
        t.join()
    assert errors == []
    assert peer.call("bytes", 0, 64 * chunk) == bytes(src[:64 * chunk].numpy())
    assert sorted(int(m) for n, m in peer.call("notifies") if n == "sync") == list(range(48, 64))


def test_bad_addresses_fail_with_the_peer_named(peer, sender):
    be, src = sender
    outside = alloc(64)  # never registered here
    with pytest.raises(ValueError, match=r"srcs\[0\]"):
        be.post_writes(peer.session, [outside.data_ptr()], [peer.base], [64])
    # Destination outside what the peer registered: the receiver rejects it, the write fails.
    h = be.post_writes(peer.session, [src.data_ptr()], [peer.base + BUF], [64])
    assert be.wait(h, WAIT_S) is WriteState.FAILED
    assert peer.session in h.error
    with pytest.raises(TransferError, match=peer.session):
        be.write_sync(peer.session, [src.data_ptr()], [peer.base + BUF], [64])


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_peer_fails_fast_and_probe_says_no(sender):
    be, src = sender
    nobody = f"127.0.0.1:{_closed_port()}"
    h = be.post_writes(nobody, [src.data_ptr()], [4096], [64])
    assert be.wait(h, WAIT_S) is WriteState.FAILED
    assert nobody in h.error
    assert not be.probe(nobody)
    with pytest.raises(TransferError, match=nobody):
        be.write_sync(nobody, [src.data_ptr()], [4096], [64])


def test_peer_killed_after_contact(backend_name, sender):
    be, src = sender
    victim = Peer(1 << 20, backend_name)
    try:
        victim.link(be)
        assert be.probe(victim.session)
        h = be.post_writes(victim.session, [src.data_ptr()], [victim.base], [4096])
        assert be.wait(h, WAIT_S) is WriteState.DONE
        victim.kill()
        h = be.post_writes(victim.session, [src.data_ptr()], [victim.base], [4096])
        assert be.wait(h, WAIT_S) is WriteState.FAILED
        assert not be.probe(victim.session)
    finally:
        victim.stop()


# How long each backend lets a write wait for a peer that does not answer, set short here.
IMPATIENT = {"mooncake": {"connect_timeout_s": 1.0}, "nixl": {"stall_timeout_s": 1.0},
             "memory": {"stall_timeout_s": 1.0}}


def test_first_contact_with_a_hung_peer_blocks_nobody(backend_name, peer):
    """A stopped peer never answers; writes to it fail after the connect timeout while other
    peers' writes go on, and it is contacted afresh once it answers again."""
    be = create_transfer_backend(backend_name, **IMPATIENT[backend_name])
    src = alloc(4096)
    be.register([(src.data_ptr(), 4096)])
    hung = Peer(1 << 20, backend_name)
    try:
        hung.link(be)
        peer.link(be)
        hung.freeze()
        src[:4096] = 6
        stuck = be.post_writes(hung.session, [src.data_ptr()], [hung.base], [4096])  # returns at once
        h = be.post_writes(peer.session, [src.data_ptr()], [peer.base], [4096])
        assert be.wait(h, WAIT_S) is WriteState.DONE
        assert be.wait(stuck, WAIT_S) is WriteState.FAILED
        assert "did not answer" in stuck.error
        with pytest.raises(TransferError, match="did not answer"):
            be.write_sync(hung.session, [src.data_ptr()], [hung.base], [4096])
        hung.thaw()
        again = be.post_writes(hung.session, [src.data_ptr()], [hung.base], [4096])
        assert be.wait(again, WAIT_S) is WriteState.DONE, again.error
        assert hung.call("mismatches", 0, 4096, 6) == 0
    finally:
        hung.thaw()
        hung.stop()
        be.close()


def test_close_waits_for_in_flight_writes_and_is_final(backend_name, peer):
    be = create_transfer_backend(backend_name)
    src = alloc(4 << 20)
    src.fill_(7)
    be.register([(src.data_ptr(), src.numel())])
    peer.link(be)
    h = be.post_writes(peer.session, [src.data_ptr()], [peer.base], [4 << 20])
    be.close()
    be.close()  # idempotent
    state = be.poll(h)
    assert state is not WriteState.PENDING, "close returned with a write in flight"
    if state is WriteState.DONE:
        assert peer.call("mismatches", 0, 4 << 20, 7) == 0
    else:
        assert "closed" in h.error
    with pytest.raises(TransferError, match="closed"):
        be.post_writes(peer.session, [src.data_ptr()], [peer.base], [1])
    assert be.outstanding() == Outstanding(0, 0)


# --- fault injection around the real engine ----------------------------------------------------


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def faulty(sender):
    be, src = sender
    clock = FakeClock()
    return FaultInjectingBackend(be, clock=clock), src, clock


def test_fault_failing_peer_sends_nothing(peer, faulty):
    fb, src, _ = faulty
    peer.call("fill", 0, 256, 0)
    src[:256] = 9
    fb.fail_writes_to(peer.session)
    h = fb.post_writes(peer.session, [src.data_ptr()], [peer.base], [256])
    assert fb.wait(h, WAIT_S) is WriteState.FAILED
    assert "injected" in h.error
    with pytest.raises(TransferError, match="injected"):
        fb.write_sync(peer.session, [src.data_ptr()], [peer.base], [256])
    assert peer.call("mismatches", 0, 256, 0) == 0  # nothing landed


def test_fault_budget_lets_the_first_writes_land(peer, faulty):
    fb, src, _ = faulty
    peer.call("fill", 0, 4096, 0)
    src[:8192] = 5
    fb.fail_after(2)
    # Four separate writes (sources every other KiB): two land, the batch fails.
    h = fb.post_writes(peer.session, [src.data_ptr() + 2048 * i for i in range(4)],
                       [peer.base + 1024 * i for i in range(4)], [1024] * 4)
    assert fb.wait(h, WAIT_S) is WriteState.FAILED
    assert peer.call("mismatches", 0, 2048, 5) == 0
    assert peer.call("mismatches", 2048, 2048, 0) == 0


def test_fault_hold_keeps_landed_batches_pending(peer, faulty):
    fb, src, clock = faulty
    src[:512] = 3
    fb.hold()
    h = fb.post_writes(peer.session, [src.data_ptr()], [peer.base], [512])
    assert fb.inner.wait(fb.inner_handle(h), WAIT_S) is WriteState.DONE
    assert peer.call("mismatches", 0, 512, 3) == 0  # landed ...
    assert fb.poll(h) is WriteState.PENDING  # ... but held
    fb.release()
    assert fb.poll(h) is WriteState.DONE

    fb.hold(seconds=5.0)
    h = fb.post_writes(peer.session, [src.data_ptr()], [peer.base], [512])
    assert fb.inner.wait(fb.inner_handle(h), WAIT_S) is WriteState.DONE
    assert fb.poll(h) is WriteState.PENDING
    clock.now += 5.0
    assert fb.poll(h) is WriteState.DONE


def test_fault_dropped_notify_still_writes_the_data(peer, faulty):
    fb, src, _ = faulty
    peer.call("notifies")  # drain
    src[:128] = 4
    fb.drop_notifies()
    fb.write_sync(peer.session, [src.data_ptr()], [peer.base], [128], notify=("room-x", "done"))
    assert peer.call("mismatches", 0, 128, 4) == 0
    assert peer.call("notifies") == []
    fb.reset()
    fb.write_sync(peer.session, [src.data_ptr()], [peer.base], [128], notify=("room-y", "done"))
    assert peer.call("notifies") == [("room-y", "done")]


def _random_failures(fb, peer, src, n: int) -> list[bool]:
    """Post ``n`` one-KiB batches, each to its own KiB (value i % 200 + 1); which ones failed.
    Every batch that did not fail has landed its bytes."""
    peer.call("fill", 0, 1024 * n, 0)
    for i in range(n):
        src[1024 * i:1024 * (i + 1)] = i % 200 + 1
    handles = [fb.post_writes(peer.session, [src.data_ptr() + 1024 * i], [peer.base + 1024 * i], [1024])
               for i in range(n)]
    failed = [fb.wait(h, WAIT_S) is WriteState.FAILED for h in handles]
    for i, f in enumerate(failed):
        assert peer.call("mismatches", 1024 * i, 1024, 0 if f else i % 200 + 1) == 0, (i, f)
    return failed


def test_fault_fail_rate_drops_that_share_of_batches_reproducibly(peer, faulty):
    fb, src, _ = faulty
    fb.fail_rate(0.25)
    fb.seed(11)
    first = _random_failures(fb, peer, src, 200)
    assert 20 <= sum(first) <= 80, sum(first)  # 50 expected; the bounds are ~4 sigma
    fb.seed(11)
    assert _random_failures(fb, peer, src, 200) == first  # the same seed, the same drills
    fb.fail_rate(1.0)
    with pytest.raises(TransferError, match="fail_rate"):
        fb.write_sync(peer.session, [src.data_ptr()], [peer.base], [128])
    fb.reset()
    assert not any(_random_failures(fb, peer, src, 50))


def test_fault_delay_rate_posts_that_share_of_batches_late(peer, faulty):
    fb, src, _ = faulty
    src[:256] = 6
    fb.delay_rate(1.0)
    fb.delay_s(3.0)
    h = fb.post_writes(peer.session, [src.data_ptr()], [peer.base], [256])
    assert fb.inner_handle(h) is _LATE and fb.poll(h) is WriteState.PENDING  # not yet handed on
    assert fb.outstanding().batches >= 1
    assert fb.wait(h, WAIT_S) is WriteState.DONE
    assert peer.call("mismatches", 0, 256, 6) == 0
    fb.delay_rate(0.0)  # none delayed: handed to the engine at once
    h = fb.post_writes(peer.session, [src.data_ptr()], [peer.base], [256])
    assert fb.inner_handle(h) is not _LATE
    assert fb.wait(h, WAIT_S) is WriteState.DONE


@pytest.mark.parametrize("spec, field", [("fail_rate=1.5", "fail_rate"), ("delay_rate=-0.1", "delay_rate"),
                                         ("delay_s=-1", "delay_s"), ("seed=x", "seed"), ("fail_rate=nan", "fail_rate")])
def test_fault_spec_out_of_range_names_the_knob(spec, field):
    with pytest.raises(ValueError, match=f"{FAULTS_ENV}: {field}"):
        with_faults(create_transfer_backend("memory"), spec)


def test_fault_spec_sets_the_rates(peer, sender):
    be, src = sender
    fb = with_faults(be, "fail_rate=1,delay_rate=0.5,delay_s=0.25,seed=3")
    assert isinstance(fb, FaultInjectingBackend)
    h = fb.post_writes(peer.session, [src.data_ptr()], [peer.base], [64])
    assert fb.wait(h, WAIT_S) is WriteState.FAILED and "fail_rate=1.0" in h.error


def test_register_unregister_and_overlap(peer, sender):
    be, _ = sender
    buf = alloc(8192)
    be.register([(buf.data_ptr(), 4096)])
    with pytest.raises(TransferError):
        be.register([(buf.data_ptr() + 1024, 4096)])  # overlaps: refused
    h = be.post_writes(peer.session, [buf.data_ptr()], [peer.base], [4096])
    assert be.wait(h, WAIT_S) is WriteState.DONE
    be.unregister([buf.data_ptr()])
    with pytest.raises(ValueError, match=r"srcs\[0\]"):
        be.post_writes(peer.session, [buf.data_ptr()], [peer.base], [4096])
    with pytest.raises(ValueError, match="is not the start of a registered region"):
        be.unregister([buf.data_ptr()])
    be.register([(buf.data_ptr() + 1024, 4096)])  # free again: the overlap is gone
    be.unregister([buf.data_ptr() + 1024])
    with pytest.raises(ValueError, match=r"regions\[0\]"):
        be.register([(buf.data_ptr(), 0)])


# --- resource accounting -----------------------------------------------------------------------


def test_outstanding_counts_batches_until_terminal_and_regions(peer, sender):
    be, src = sender
    before = be.outstanding()
    assert before.batches == 0
    buf = alloc(4096)
    be.register([(buf.data_ptr(), 4096)])
    assert be.outstanding() == Outstanding(0, before.regions + 1)
    peer.freeze()  # the write stays in flight until the peer runs again
    try:
        h = be.post_writes(peer.session, [buf.data_ptr()], [peer.base], [4096])
        assert be.outstanding().batches == 1
    finally:
        peer.thaw()
    assert be.wait(h, WAIT_S) is WriteState.DONE, h.error
    assert be.outstanding().batches == 0
    fb = FaultInjectingBackend(be)
    fb.hold()
    h = fb.post_writes(peer.session, [buf.data_ptr()], [peer.base], [4096])
    assert be.wait(fb.inner_handle(h), WAIT_S) is WriteState.DONE
    assert (be.outstanding().batches, fb.outstanding().batches) == (0, 1)  # landed, but still held
    fb.release()
    assert fb.poll(h) is WriteState.DONE and fb.outstanding().batches == 0
    be.unregister([buf.data_ptr()])
    assert be.outstanding() == before


# --- the in-memory backend's own promises -------------------------------------------------------


def test_a_write_that_gave_up_on_a_frozen_peer_never_lands():
    a, b = create_transfer_backend("memory", stall_timeout_s=0.2), create_transfer_backend("memory")
    src, dst = alloc(4096), alloc(4096)
    a.register([(src.data_ptr(), 4096)])
    b.register([(dst.data_ptr(), 4096)])
    src.fill_(3)
    try:
        b.freeze()
        assert not a.probe(b.session_id, timeout_s=0.05)
        h = a.post_writes(b.session_id, [src.data_ptr()], [dst.data_ptr()], [4096])
        assert a.wait(h, WAIT_S) is WriteState.FAILED and "did not answer" in h.error
        b.thaw()
        assert a.probe(b.session_id)
        assert a.outstanding().batches == 0 and int(dst.count_nonzero()) == 0
    finally:
        a.close()
        b.close()
    assert not create_transfer_backend("memory").probe(b.session_id)  # closed: gone from the fabric


@needs_nixl
def test_nixl_refuses_a_record_whose_metadata_names_another_agent():
    """A record's transfer_info must describe the session it is published for: NIXL metadata of
    one agent under another's session is refused (nothing gets connected under either name)."""
    a, b, c = (create_transfer_backend("nixl") for _ in range(3))
    try:
        with pytest.raises(TransferError, match=f"transfer_info of {c.session_id}: it describes agent"):
            a.connect(c.session_id, b.peer_info)
        with pytest.raises(TransferError, match="transfer_info of"):
            a.connect(b.session_id, "not base64!")
        src = alloc(64)
        a.register([(src.data_ptr(), 64)])
        h = a.post_writes(b.session_id, [src.data_ptr()], [4096], [64])
        assert a.wait(h, WAIT_S) is WriteState.FAILED and "no transfer record" in h.error
    finally:
        for be in (a, b, c):
            be.close()


@needs_nixl
def test_nixl_drops_a_notify_over_the_size_bound_and_still_lands_its_data():
    """A notify is held by the receiver until taken, so its size is bounded (``MAX_NOTIFY_BYTES`` of
    encoded notify): one byte over it is dropped, though its write lands and is answered; one at the
    bound is delivered."""
    from pdserve.transfer.nixl import MAX_NOTIFY_BYTES

    a, b = create_transfer_backend("nixl"), create_transfer_backend("nixl")
    src, dst = alloc(4096), alloc(4096)
    try:
        a.register([(src.data_ptr(), 4096)])
        b.register([(dst.data_ptr(), 4096)])
        a.connect(b.session_id, b.peer_info)
        b.connect(a.session_id, a.peer_info)
        overhead = len(json.dumps(["room", ""]))  # the encoded (name, msg) pair around msg
        for val, msg_bytes, delivered in ((1, MAX_NOTIFY_BYTES - overhead + 1, False),
                                          (2, MAX_NOTIFY_BYTES - overhead, True)):
            src.fill_(val)
            msg = "m" * msg_bytes
            a.write_sync(b.session_id, [src.data_ptr()], [dst.data_ptr()], [4096], notify=("room", msg))
            assert int(dst.eq(val).sum()) == 4096  # landed, and DONE: the receiver answered its batch
            assert b.notifies() == ([("room", msg)] if delivered else []), msg_bytes
    finally:
        a.close()
        b.close()


@needs_nixl
def test_a_process_with_nixl_agents_exits_cleanly():
    """Two agents that moved bytes, one closed and one left to the interpreter's exit: the process
    ends with status 0 (UCX's InfiniBand modules, loaded by default, made every such process die
    with SIGSEGV in libnl-route's destructor at exit; nixl.py keeps them out on TCP)."""
    import subprocess

    code = ("from pdserve.transfer import create_transfer_backend, WriteState\n"
            "import torch\n"
            "a, b = create_transfer_backend('nixl'), create_transfer_backend('nixl')\n"
            "src, dst = torch.ones(4096, dtype=torch.uint8), torch.zeros(4096, dtype=torch.uint8)\n"
            "a.register([(src.data_ptr(), 4096)]); b.register([(dst.data_ptr(), 4096)])\n"
            "a.connect(b.session_id, b.peer_info); b.connect(a.session_id, a.peer_info)\n"
            "h = a.post_writes(b.session_id, [src.data_ptr()], [dst.data_ptr()], [4096])\n"
            "assert a.wait(h, 60) is WriteState.DONE and int(dst.sum()) == 4096, h.error\n"
            "a.close()\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}  # the backend's defaults only
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])


def test_backend_names_match_the_config_and_servers_refuse_memory():
    from pdserve.config import SERVER_TRANSFER_BACKENDS, TRANSFER_BACKENDS, DisaggConfig
    from pdserve.transfer import BACKEND_NAMES

    assert TRANSFER_BACKENDS == BACKEND_NAMES and set(SERVER_TRANSFER_BACKENDS) <= set(BACKEND_NAMES)
    DisaggConfig("decode", "memory")  # an in-process pair may use it
    with pytest.raises(ValueError, match="disaggregation_transfer_backend: 'memory' moves KV only"):
        DisaggConfig("decode", "memory").check_servable()
    DisaggConfig("decode", "mooncake").check_servable()
    DisaggConfig("decode", "nixl").check_servable()
    DisaggConfig("null", "memory").check_servable()  # a colocated server transfers nothing


def test_host_extras_install_the_tested_nixl():
    """CI installs ``.[test,cpu]`` and the images ``.[cpu]`` / ``.[cuda]``: each brings the NIXL
    version this backend was measured on, so the nixl tests run wherever the Mooncake ones do."""
    from pathlib import Path

    import tomllib

    extras = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]
    for name in ("nixl", "cpu", "cuda", "gpu"):
        assert "nixl-cu12==1.5.1" in extras["optional-dependencies"][name], name
