"""web/listen.py: what the server's frontend and the router share to listen and run."""

from __future__ import annotations

import asyncio

from pdserve.web.listen import run_event_loop


def test_the_http_programs_run_on_uvloop() -> None:
    """uvloop is a dependency: the frontend's and the router's loop is uvloop's, and the result comes back."""

    async def main() -> str:
        return type(asyncio.get_running_loop()).__module__

    assert run_event_loop(main()).startswith("uvloop")
