"""The server's P/D role now, held in one place per process.

``--disaggregation-mode`` is only where a server starts: ``POST /pd_role_switch`` changes the role
while it runs. Everything that reads the role after start-up reads this object, so nothing goes
stale after a switch: in the frontend the request checks, ``/get_server_info``, the router's
role header and the ``pd_role`` gauge in ``/metrics``; in the scheduler the mode it runs.
"""

from __future__ import annotations

from collections.abc import Callable

ROLES = ("null", "prefill", "decode")  # null: colocated, not P/D


class LiveRole:
    """One process's role. ``set`` changes it and tells every watcher (after the change)."""

    def __init__(self, initial: str):
        self._check(initial)
        self._value = initial
        self._watchers: list[Callable[[str], None]] = []

    @property
    def value(self) -> str:
        return self._value

    @property
    def disaggregated(self) -> bool:
        return self._value != "null"

    def set(self, role: str) -> None:
        self._check(role)
        if not self.disaggregated or role == "null":
            raise ValueError(f"role: a {self._value!r} server cannot become {role!r}; only prefill <-> decode")
        self._value = role
        for watch in self._watchers:
            watch(role)

    def watch(self, on_change: Callable[[str], None]) -> None:
        """Call ``on_change(role)`` now and after every change."""
        self._watchers.append(on_change)
        on_change(self._value)

    @staticmethod
    def _check(role: str) -> None:
        if role not in ROLES:
            raise ValueError(f"role: must be one of {ROLES}, got {role!r}")

    def __repr__(self) -> str:
        return f"LiveRole({self._value!r})"
