"""web/streaming.py: waiting on a request while watching its client, and the SSE response."""

from __future__ import annotations

import asyncio
import gc

import pytest
from starlette.responses import StreamingResponse

from pdserve.web.errors import RequestError
from pdserve.web.streaming import SSE_DONE, SSEResponse, sse, sse_events, sse_response, until_disconnect


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


def test_the_client_is_asked_every_poll_until_the_awaitable_ends_and_never_after():
    async def main():
        client = _Client(gone=False)
        tasks_while_waiting = []

        async def work():
            tasks_while_waiting.append(len(asyncio.all_tasks()))  # before the first poll: the caller alone
            await asyncio.sleep(0.05)
            return "done"

        got = await until_disconnect(client, work(), poll_s=0.005)
        polls = client.polls
        await asyncio.sleep(0.05)  # a poll left behind would still ask (and could cancel this task)
        return got, polls, client.polls, tasks_while_waiting

    got, polls, later, tasks = asyncio.run(main())
    assert got == "done"
    assert polls >= 3, "a client that stays is asked again and again"
    assert later == polls, "nothing asks once the awaitable ended"
    assert tasks == [1], "no watcher task exists before the first poll is due"


def test_a_request_s_wait_leaves_nothing_for_the_cyclic_collector():
    """Everything a wait made is freed when it returns (a cycle would hold each request's scope and
    task until the collector's next pass, and make that pass longer)."""
    async def main():
        async def work():
            await asyncio.sleep(0)
            return 1

        gc.collect()
        gc.disable()
        try:
            for _ in range(100):
                await until_disconnect(_Client(gone=False), work(), poll_s=60)
            return gc.collect()
        finally:
            gc.enable()

    assert asyncio.run(main()) < 20  # not one cycle per request


async def _chunks(items: list, error: RequestError | None = None):
    for item in items:
        yield item
    if error is not None:
        raise error


def _writes(items: list, error: RequestError | None = None, tail=lambda: []) -> list[bytes]:
    async def main():
        gen = _chunks(items, error)
        first = await gen.__anext__()
        return [w async for w in sse_events(first, gen, lambda i: [sse({"i": i})] * (i % 2 + 1), tail)]

    return asyncio.run(main())


def test_sse_events_writes_once_per_item_and_the_tail_with_done():
    usage = sse({"usage": 1})
    writes = _writes([0, 1, 2], tail=lambda: [usage, usage])
    assert writes == [sse({"i": 0}), sse({"i": 1}) * 2, sse({"i": 2}), usage + usage + SSE_DONE]
    assert _writes([0]) == [sse({"i": 0}), SSE_DONE]


def test_sse_events_sends_an_error_after_the_start_as_an_event_then_done():
    err = RequestError("scheduler went away", status=503)
    writes = _writes([0, 1], err, tail=lambda: [sse({"usage": 1})])
    assert writes == [sse({"i": 0}), sse({"i": 1}) * 2, sse(err.body()) + SSE_DONE]


# ------------------------------------------------------------ SSEResponse
def _starlette_sse(events) -> StreamingResponse:
    """The response SSEResponse replaced (its slow twin): what clients received before."""
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


class _Events:
    """An event stream whose cleanup is seen (generate()'s finally: the abort to the scheduler)."""

    def __init__(self, n: int, error: Exception | None = None, block_after: int | None = None):
        self.n, self.error, self.block_after = n, error, block_after
        self.closed = False

    async def gen(self):
        try:
            for i in range(self.n):
                if i == self.block_after:
                    await asyncio.Event().wait()  # a request whose next token has not come
                yield sse({"i": i})
                await asyncio.sleep(0)
            if self.error is not None:
                raise self.error
        finally:
            self.closed = True


async def _serve(response, leave_after: int | None = None, limit_s: float | None = 10) -> list[dict]:
    """The ASGI messages ``response`` sends to a server speaking ASGI 2.3 (uvicorn's); the client
    leaves once ``leave_after`` body messages were sent (``receive`` then answers http.disconnect)."""
    messages: list[dict] = []
    gone = asyncio.Event()

    async def receive():
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        messages.append(message)
        if sum(m["type"] == "http.response.body" for m in messages) == leave_after:
            gone.set()

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}}
    await asyncio.wait_for(response(scope, receive, send), limit_s)  # a stream that missed the client leaving fails
    return messages


def _both(make_events, leave_after: int | None = None) -> tuple[list[dict], list[dict], bool, bool]:
    """(messages of SSEResponse, of StreamingResponse, whether each one's events were cleaned up)."""
    ours, theirs = make_events(), make_events()
    new = asyncio.run(_serve(sse_response(ours.gen()), leave_after))
    old = asyncio.run(_serve(_starlette_sse(theirs.gen()), leave_after))
    return new, old, ours.closed, theirs.closed


def test_sse_response_sends_what_starlette_s_streaming_response_sent():
    new, old, closed, _ = _both(lambda: _Events(3))
    assert new == old
    assert new[0]["headers"] == _starlette_sse(_Events(0).gen()).raw_headers
    assert [m.get("body") for m in new[1:]] == [sse({"i": 0}), sse({"i": 1}), sse({"i": 2}), b""]
    assert new[-1]["more_body"] is False and closed
    assert isinstance(sse_response(_Events(0).gen()), SSEResponse)


def test_a_client_that_leaves_mid_stream_ends_the_events_and_the_response_returns():
    for block_after in (None, 2):  # the client leaves while an event is sent, or while one is awaited
        new, old, closed, old_closed = _both(lambda: _Events(50, block_after=block_after), leave_after=2)  # noqa: B023
        assert closed and old_closed  # the request aborts
        assert len(new) < 10 and not any(m.get("more_body") is False for m in new)  # no end of a stream sent
        assert new[:3] == old[:3]


def test_an_error_in_the_events_after_the_first_propagates_as_from_streaming_response():
    for response in (sse_response, _starlette_sse):
        events = _Events(2, error=KeyError("boom"))
        with pytest.raises(KeyError):
            asyncio.run(_serve(response(events.gen())))
        assert events.closed


def test_a_cancelled_request_task_cancels_the_stream_and_propagates_leaving_no_task():
    async def main():
        events = _Events(5, block_after=1)
        serving = asyncio.ensure_future(_serve(sse_response(events.gen()), limit_s=None))  # no task between
        for _ in range(10):
            await asyncio.sleep(0)
        serving.cancel()  # the server shutting down
        with pytest.raises(asyncio.CancelledError):
            await serving
        await asyncio.sleep(0)
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        return events.closed, others

    closed, others = asyncio.run(main())
    assert closed and others == []


def test_a_shutdown_as_the_client_leaves_still_propagates():
    async def main():
        events = _Events(5, block_after=1)
        gone = asyncio.Event()

        async def receive():
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(_message):
            pass

        serving = asyncio.ensure_future(sse_response(events.gen())({"type": "http"}, receive, send))
        for _ in range(10):
            await asyncio.sleep(0)
        gone.set()
        serving.cancel()
        with pytest.raises(asyncio.CancelledError):
            await serving
        return events.closed

    assert asyncio.run(main())


def test_a_finished_stream_leaves_no_watcher_task():
    async def main():
        await _serve(sse_response(_Events(2).gen()))
        await asyncio.sleep(0)
        return [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]

    assert asyncio.run(main()) == []
