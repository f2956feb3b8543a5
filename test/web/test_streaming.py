"""web/streaming.py: waiting on a request while watching its client."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.web.errors import RequestError
from pdserve.web.streaming import until_disconnect


class _Client:
    """The part of a starlette Request that until_disconnect reads."""

    def __init__(self, gone: bool):
        self.gone = gone
        self.polls = 0

    async def is_disconnected(self) -> bool:
        self.polls += 1
        return self.gone


def test_the_awaitable_runs_in_the_caller_s_task_before_anything_else_is_scheduled():
    async def main():
        caller = asyncio.current_task()
        order: list[str] = []

        async def submit_then_wait(reply: asyncio.Future):
            order.append("sent")  # a request's send to the scheduler
            assert asyncio.current_task() is caller
            return await reply

        reply = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_soon(order.append, "other callback")
        asyncio.get_running_loop().call_soon(reply.set_result, "first chunk")
        got = await until_disconnect(_Client(gone=False), submit_then_wait(reply), poll_s=60)
        return got, order

    got, order = asyncio.run(main())
    assert got == "first chunk"
    assert order == ["sent", "other callback"]  # sent on the spot, not after the loop's queue


def test_a_client_that_left_gets_499_and_the_awaitable_is_cancelled():
    async def main():
        client = _Client(gone=True)
        cleaned = []

        async def wait_forever():
            try:
                await asyncio.Event().wait()
            finally:
                cleaned.append(True)  # generate()'s finally: the abort to the scheduler

        with pytest.raises(RequestError) as err:
            await until_disconnect(client, wait_forever(), poll_s=0.001)
        task = asyncio.current_task()
        return err.value.status, cleaned, client.polls, task.cancelling() if hasattr(task, "cancelling") else 0

    status, cleaned, polls, still_cancelling = asyncio.run(main())
    assert status == 499
    assert cleaned == [True]
    assert polls >= 1
    assert still_cancelling == 0  # the caller goes on (writes the 499), not cancelled


def test_another_cancellation_of_the_caller_still_propagates():
    async def main():
        started = asyncio.Event()

        async def wait_forever():
            started.set()
            await asyncio.Event().wait()

        task = asyncio.ensure_future(until_disconnect(_Client(gone=False), wait_forever(), poll_s=60))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return task.cancelled()

    assert asyncio.run(main())
