"""Helpers shared by the HTTP APIs: JSON and SSE framing (orjson), first-chunk priming,
disconnect-aware waits, merging the streams of parallel samples."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import TypeVar

import orjson
from fastapi import Request
from fastapi.responses import Response
from starlette.types import Receive, Scope, Send

from pdserve.web.errors import RequestError

T = TypeVar("T")

SSE_DONE = b"data: [DONE]\n\n"
DISCONNECT_POLL_S = 1.0


def sse(obj) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def json_response(obj, status_code: int = 200) -> Response:
    return Response(orjson.dumps(obj), status_code=status_code, media_type="application/json")


async def prime(gen: AsyncIterator[T]) -> T:
    """First item of ``gen``, awaited before any response byte is sent, so an
    early rejection still becomes an HTTP error status instead of a broken stream."""
    return await gen.__anext__()


# What Starlette's StreamingResponse(media_type="text/event-stream", headers={"Cache-Control": "no-cache",
# "X-Accel-Buffering": "no"}) sends, in its order (test_streaming checks they agree)
SSE_HEADERS = [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no"),
               (b"content-type", b"text/event-stream; charset=utf-8")]


def sse_response(events: AsyncIterator[bytes]) -> SSEResponse:
    return SSEResponse(events)


class SSEResponse(Response):
    """``events`` as a ``text/event-stream`` response; the bytes on the wire are StreamingResponse's.

    Starlette's StreamingResponse sends the events from a task under an anyio task group (a cancel
    scope, a task-runner coroutine and a wrapper around every resumption, two more coroutine levels
    each event passes through) while the request's task listens for the client's disconnect. Here
    two plain tasks do the same: ``_pump`` sends the events, resumed with no frame above it but
    the events' own generators, and a watcher waits for ``http.disconnect``. If the client leaves
    first, the pump is cancelled, which ends ``events`` (its cleanup aborts the request), and the
    response returns normally; an error in ``events`` propagates (the server closes the
    connection); a cancellation of the request's task (shutdown) cancels both and propagates.
    """

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes]):
        self.events = events
        self.status_code = 200
        self.background = None
        self.raw_headers = list(SSE_HEADERS)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        pump = asyncio.ensure_future(self._pump(send))
        watch = asyncio.ensure_future(_disconnected(receive))
        pump.add_done_callback(lambda _: watch.cancel())
        watch.add_done_callback(lambda _: pump.cancel())
        try:
            await pump  # a cancellation of this task reaches the pump, and this await ends once the pump has
        except asyncio.CancelledError:
            if not _left(watch) or _cancelling(asyncio.current_task()):  # not the client's leaving, or not only
                raise

    async def _pump(self, send: Send) -> None:
        async for chunk in self.events:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _disconnected(receive: Receive) -> None:
    """Returns once the client is gone."""
    while (await receive())["type"] != "http.disconnect":
        pass  # a pipelined request's bytes are not this response's business (StreamingResponse's rule)


def _left(watch: asyncio.Task) -> bool:
    """Whether ``watch`` saw the client leave (an error in it propagates, as in a task group)."""
    if not watch.done() or watch.cancelled():
        return False
    error = watch.exception()
    if error is not None:
        raise error
    return True


def _cancelling(task: asyncio.Task | None) -> bool:
    """Whether ``task`` itself is being cancelled (Python < 3.11 cannot tell: no)."""
    return task is not None and getattr(task, "cancelling", lambda: 0)() > 0


async def sse_events(first: T, gen: AsyncGenerator[T, None], render: Callable[[T], list[bytes]],
                     tail: Callable[[], list[bytes]] = lambda: []) -> AsyncGenerator[bytes, None]:
    """Render ``first`` and the rest of ``gen`` as SSE, then ``tail()`` and ``[DONE]``.

    One write per wake-up, however many events it makes; the tail (a usage event) and ``[DONE]``
    go out as one write too: each write is a syscall and a pass through every ASGI layer, and a
    short stream (one token) had five of them. An error after the response started is sent as an
    ``{"error": ...}`` event, before ``[DONE]`` (the status line is gone by then). If the client
    leaves, the cancellation reaches ``gen``, whose cleanup aborts the request.
    """
    try:
        yield b"".join(render(first))
        async for item in gen:
            events = render(item)
            if events:
                yield b"".join(events)
        end = b"".join(tail())
    except RequestError as e:
        end = sse(e.body())
    finally:
        await gen.aclose()
    yield end + SSE_DONE


async def until_disconnect(request: Request, awaitable: Awaitable, poll_s: float = DISCONNECT_POLL_S):
    """Await ``awaitable``; if the client disconnects first, cancel it (which aborts its request).

    It runs in the calling task, not a task of its own: a request's first step (its send to the
    scheduler) runs now rather than after every callback the event loop already holds (32 streams'
    writes under load), and its first token resumes the caller directly rather than a second task
    that then wakes it. A ``_DisconnectPoll`` asks every ``poll_s`` whether the client left and
    cancels the caller once it did; that cancellation becomes a 499, any other one propagates.
    """
    caller = asyncio.current_task()
    assert caller is not None, "until_disconnect runs inside a task"
    poll = _DisconnectPoll(request, caller, poll_s)
    try:
        return await awaitable
    except asyncio.CancelledError:
        # Python >= 3.11 counts cancellations: ours is handled here; another one (shutdown) still propagates
        if not poll.left or (hasattr(caller, "uncancel") and caller.uncancel() > 0):
            raise
        raise RequestError("client disconnected", status=499) from None
    finally:
        poll.stop()


class _DisconnectPoll:
    """Asks every ``poll_s`` whether ``request``'s client left (``is_disconnected``) and cancels
    ``caller`` once it did. A timer between the questions, a task only while one is asked: a
    request that ends within ``poll_s`` costs a timer, not a task, on its way in. An object, not
    closures that call each other: those would form a cycle holding the request until the
    collector's next pass."""

    def __init__(self, request: Request, caller: asyncio.Task, poll_s: float):
        self.request, self.caller, self.poll_s = request, caller, poll_s
        self.loop = asyncio.get_running_loop()
        self.left = self.done = False
        self.asking: asyncio.Task | None = None
        self.timer = self.loop.call_later(poll_s, self._ask)

    def _ask(self) -> None:
        if self.done:
            return
        self.asking = self.loop.create_task(self.request.is_disconnected())
        self.asking.add_done_callback(self._answered)

    def _answered(self, task: asyncio.Task) -> None:
        if self.done or task.cancelled():  # an answer that came in as the awaitable ended: nothing to do
            return
        if task.result():  # an error here stops the polling (the loop logs it)
            self.left = True
            self.caller.cancel()
        else:
            self.timer = self.loop.call_later(self.poll_s, self._ask)

    def stop(self) -> None:
        self.done = True
        self.timer.cancel()
        if self.asking is not None:
            self.asking.cancel()


async def gather_or_cancel(*awaitables: Awaitable) -> list:
    """Like ``asyncio.gather``, but the first failure cancels the rest (their requests abort)."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for t in tasks:  # the others may still run: their results do not exist yet
            if t.done() and not t.cancelled() and (error := t.exception()) is not None:
                raise error
        return [t.result() for t in tasks]
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def collect(gen: AsyncIterator[T]) -> T | None:
    """The single (final) item of a non-streaming generator."""
    last = None
    async for item in gen:
        last = item
    return last


async def merge_streams(gens: list[AsyncGenerator[T, None]]) -> AsyncGenerator[tuple[int, T], None]:
    """``(i, item)`` from every generator as items arrive; closing the merge (or an error in
    one of them) cancels the rest, so their requests abort."""
    pending = {asyncio.ensure_future(g.__anext__()): i for i, g in enumerate(gens)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=lambda t: pending[t]):
                i = pending.pop(task)
                try:
                    item = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(gens[i].__anext__())] = i
                yield i, item
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for g in gens:
            await g.aclose()
