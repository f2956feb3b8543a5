"""The router's ``/health_generate``: it bypasses admission and generates on every worker, so it is
bounded (one fan-out at a time, shared by the callers meanwhile) and needs the key where keys are set."""

from __future__ import annotations

import asyncio
import json
import random

from pdserve.router.app import _health_generate, build_context
from pdserve.router.config import PrefillSpec, RouterArgs
from pdserve.router.proxy import UpstreamReply
from pdserve.web.api_key import ROUTE_ACCESS, Access


def test_concurrent_callers_share_one_fan_out():
    args = RouterArgs(prefill=(PrefillSpec("http://127.0.0.1:20001"),),
                      decode=("http://127.0.0.1:20002", "http://127.0.0.1:20003"))
    ctx = build_context(args, random.Random(0))
    for s in ctx.sets:
        for w in s.workers:
            s.mark_alive(w)
    asked: list[str] = []

    async def run() -> list:
        release = asyncio.Event()

        async def call(w, method, path, timeout=None, json_body=None, headers=None):
            asked.append(w.url)
            await release.wait()  # the round stays in flight until every caller has arrived
            return UpstreamReply(200, b"", "text/plain")

        ctx.proxy.call = call
        callers = [asyncio.ensure_future(_health_generate(ctx)) for _ in range(50)]
        for _ in range(10):
            await asyncio.sleep(0)
        assert len(asked) == 3  # one request per worker, not 50
        release.set()
        first = await asyncio.gather(*callers)
        again = await _health_generate(ctx)  # the round is over: the next caller starts a new one
        return [*first, again]

    replies = asyncio.run(run())
    assert len(asked) == 6
    assert {r.status_code for r in replies} == {200}
    assert len({r.body for r in replies[:-1]}) == 1
    assert [w["status"] for w in json.loads(replies[0].body)["workers"]] == [200, 200, 200]


def test_health_generate_needs_the_inference_key():
    # it used to be open: anyone could make every worker generate, outside the admission cap
    assert ROUTE_ACCESS["/health_generate"] is Access.INFERENCE
    assert ROUTE_ACCESS["/health"] is Access.OPEN
