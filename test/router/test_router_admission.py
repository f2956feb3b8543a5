"""The concurrency cap on its own (one event loop, no HTTP): slots, a FIFO queue, 429 with a
Retry-After when the queue is full, 408 after the queue timeout, and a slot handed to the next in
line (never lost) when a waiting request gives up."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.router.admission import Admission, Refused


def run(coro):
    return asyncio.run(coro)


def test_slots_then_queue_then_429_and_fifo_order():
    async def scenario():
        refused = []
        adm = Admission(2, queue_size=2, queue_timeout_s=30, on_refuse=refused.append)
        a, b = await adm.acquire(), await adm.acquire()
        order = []

        async def waiter(name):
            await adm.acquire()
            order.append(name)

        w1 = asyncio.ensure_future(waiter("w1"))
        await asyncio.sleep(0)
        w2 = asyncio.ensure_future(waiter("w2"))
        await asyncio.sleep(0)
        assert (adm.active, adm.queued) == (2, 2)
        with pytest.raises(Refused) as e:
            await adm.acquire()
        assert e.value.status == 429 and e.value.retry_after_s >= 1
        assert "max_concurrent_requests" in e.value.message and "queue_size 2" in e.value.message
        adm.release(a)
        await w1
        assert order == ["w1"] and (adm.active, adm.queued) == (2, 1)  # the slot changed hands
        adm.release(b)
        await w2
        assert order == ["w1", "w2"] and adm.queued == 0
        adm.release(None)
        adm.release(None)
        assert adm.active == 0 and refused == ["queue_full"]

    run(scenario())


def test_queue_timeout_is_408_and_leaves_the_queue():
    async def scenario():
        refused = []
        adm = Admission(1, queue_size=5, queue_timeout_s=0.05, on_refuse=refused.append)
        await adm.acquire()
        with pytest.raises(Refused) as e:
            await adm.acquire()
        assert e.value.status == 408 and "queue_timeout_secs" in e.value.message
        assert adm.queued == 0 and adm.active == 1 and refused == ["queue_timeout"]

    run(scenario())


def test_a_waiter_cancelled_as_it_is_granted_passes_the_slot_on():
    async def scenario():
        adm = Admission(1, queue_size=5, queue_timeout_s=30)
        first = await adm.acquire()
        leaving = asyncio.ensure_future(adm.acquire())
        staying = asyncio.ensure_future(adm.acquire())
        await asyncio.sleep(0)
        adm.release(first)  # granted to ``leaving`` ...
        leaving.cancel()  # ... which is cancelled before it runs again
        await asyncio.gather(leaving, return_exceptions=True)
        await asyncio.wait_for(staying, 1)  # the slot reached the next in line
        assert adm.active == 1 and adm.queued == 0

    run(scenario())


def test_no_cap_admits_everything():
    async def scenario():
        adm = Admission(None, queue_size=0, queue_timeout_s=1)
        for _ in range(1000):
            await adm.acquire()
        assert adm.active == 1000

    run(scenario())
