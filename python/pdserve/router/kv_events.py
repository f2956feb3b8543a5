"""One worker's KV events, followed on a thread: a ZMQ SUB socket feeding a ``KVIndex``.

A gap in the batch numbers (a lost batch, a restarted worker, the first batch seen) makes the
thread fetch the worker's snapshot (``GET /kv_events/snapshot``) and continue from its ``seq``;
batches queued in the socket meanwhile are applied or skipped by their numbers. The server
sends an empty heartbeat batch (its last number) every second while idle, so a silent worker
is told apart from an idle one: after ``stale_s`` without a message the index is not trusted
and the router falls back to its own guess of the worker's cache (``approx_index``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

import orjson
import zmq

from pdserve.obs.kv_event_publisher import EventCurveKeys
from pdserve.router.kv_index import KVIndex

logger = logging.getLogger(__name__)

POLL_MS = 200
MIN_RESYNC_INTERVAL_S = 1.0  # a worker whose snapshot fails is not asked again at once


class KVEventSubscriber:
    """Follows ``endpoint``; ``fetch_snapshot()`` returns the worker's snapshot (blocking, may raise).
    ``matched_blocks`` and ``num_blocks`` may be called from any thread."""

    def __init__(self, name: str, endpoint: str, fetch_snapshot: Callable[[], dict], stale_s: float = 5.0,
                 topic: str = "", clock: Callable[[], float] = time.monotonic, curve: EventCurveKeys | None = None):
        self.name = name
        self.endpoint = endpoint
        self.curve = curve  # the publisher is a CURVE server (it is reachable from other machines)
        self.fetch_snapshot = fetch_snapshot
        self.stale_s = stale_s
        self.topic = topic
        self.clock = clock
        self.index = KVIndex()
        self.lock = threading.Lock()
        self.epoch: int | None = None  # the publisher's; a new one means it restarted and numbers afresh
        self.last_message = -float("inf")
        self.last_failure = -float("inf")  # a failed snapshot is not retried for MIN_RESYNC_INTERVAL_S
        self.batches = 0
        self.gaps = 0
        self.resyncs = 0
        self.resync_failures = 0
        self.failing = False  # the last snapshot failed
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kv-events {name}", daemon=True)

    def start(self) -> KVEventSubscriber:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2.0)

    # ------------------------------------------------------------- readers
    @property
    def fresh(self) -> bool:
        return self.index.seq is not None and self.clock() - self.last_message <= self.stale_s

    def matched_blocks(self, hashes: Sequence[int]) -> int:
        with self.lock:
            return self.index.matched_blocks(hashes) if self.fresh else 0

    @property
    def num_blocks(self) -> int:
        with self.lock:
            return self.index.num_blocks if self.fresh else 0

    def status(self) -> dict:
        """What ``/get_server_info`` of the router shows for this worker."""
        with self.lock:
            seq, blocks = self.index.seq, self.index.num_blocks
        return {"endpoint": self.endpoint, "seq": seq, "blocks": blocks, "fresh": self.fresh,
                "batches": self.batches, "gaps": self.gaps, "resyncs": self.resyncs}

    # -------------------------------------------------------------- thread
    def _run(self) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        if self.curve is not None:
            self.curve.secure_subscriber(sock)
        try:
            sock.connect(self.endpoint)
            while not self._stop.is_set():
                if sock.poll(POLL_MS):
                    self.handle(sock.recv_multipart())
        except zmq.ZMQError as e:
            logger.warning("KV events of %s (%s): %s; routed on the router's own guess of its cache", self.name,
                           self.endpoint, e)
        finally:
            sock.close()
            ctx.term()

    def handle(self, frames: list[bytes]) -> None:
        """One message ``[topic, seq u64 BE, payload]``; a malformed one is logged and dropped."""
        try:
            seq = int.from_bytes(frames[1], "big")
            payload = orjson.loads(frames[2])
            events = payload["events"]
        except (IndexError, ValueError, KeyError, TypeError) as e:
            logger.warning("KV events of %s: malformed message dropped (%s)", self.name, e)
            return
        self.last_message = self.clock()
        if payload.get("epoch") != self.epoch:
            if self.epoch is not None:
                logger.info("KV events of %s: the worker restarted (new epoch); reloading its cache from the "
                            "snapshot", self.name)
            with self.lock:
                self.index.forget()
                self.epoch = payload.get("epoch")
        if not events:  # a heartbeat: the number of the last batch the worker closed
            self._check_heartbeat(seq)
            return
        try:
            with self.lock:
                applied = self.index.apply(seq, events)
        except (ValueError, KeyError, TypeError) as e:
            logger.warning("KV events of %s: batch %d malformed (%s); reloading the worker's cache from the "
                           "snapshot", self.name, seq, e)
            applied = False
        self.batches += 1
        if not applied:
            self._gap(seq)

    def _check_heartbeat(self, seq: int) -> None:
        with self.lock:
            behind = self.index.seq is None or seq > self.index.seq
        if behind:
            self._gap(seq)

    def _gap(self, seq: int) -> None:
        """Batch ``seq`` does not follow the index: first contact (or a restart, already said), or
        batches lost on the way (said: the index was wrong until the snapshot reloads it)."""
        self.gaps += 1
        known = self.index.seq
        if known is None:
            logger.debug("KV events of %s: first batch seen is %d; loading the worker's cache from the snapshot",
                         self.name, seq)
        else:
            logger.info("KV events of %s: missed batches after %d (the worker is at %d); reloading the worker's "
                        "cache from the snapshot", self.name, known, seq)
        self.resync()

    def resync(self) -> bool:
        if self.clock() - self.last_failure < MIN_RESYNC_INTERVAL_S:
            return False
        try:
            snapshot = self.fetch_snapshot()
            with self.lock:
                self.index.load_snapshot(snapshot)
        except Exception as e:  # noqa: BLE001 - any failure leaves the worker routed as empty
            self.resync_failures += 1
            self.last_failure = self.clock()
            with self.lock:
                self.index.forget()
            # said once per run of failures: the worker retries every MIN_RESYNC_INTERVAL_S while it fails
            log = logger.debug if self.failing else logger.warning
            log("KV events of %s: snapshot failed (%s: %s); routed on the router's own guess of its cache until "
                "a snapshot loads", self.name, type(e).__name__, e)
            self.failing = True
            return False
        if self.failing:
            logger.info("KV events of %s: snapshot loaded; routed on its events again", self.name)
        self.failing = False
        self.resyncs += 1
        return True
