"""LiveRole: the one record of a server's P/D role; every reader follows a switch."""

from __future__ import annotations

import pytest

from pdserve.obs.metrics import ServerMetrics
from pdserve.obs.role import LiveRole


def _gauge(metrics: ServerMetrics) -> dict[str, float]:
    return {s.labels["role"]: s.value for m in metrics.registry.collect() if m.name.endswith("pd_role")
            for s in m.samples}


def test_the_metrics_gauge_follows_every_switch() -> None:
    role, metrics = LiveRole("prefill"), ServerMetrics("m")
    role.watch(metrics.set_role)
    assert _gauge(metrics) == {"prefill": 1.0, "decode": 0.0, "null": 0.0}
    role.set("decode")
    assert role.value == "decode" and _gauge(metrics) == {"prefill": 0.0, "decode": 1.0, "null": 0.0}
    role.set("prefill")
    assert _gauge(metrics)["prefill"] == 1.0


@pytest.mark.parametrize("start, target", [("null", "prefill"), ("decode", "null"), ("prefill", "tpu")])
def test_only_prefill_and_decode_trade_places(start: str, target: str) -> None:
    role, seen = LiveRole(start), []
    role.watch(seen.append)
    with pytest.raises(ValueError, match="role"):
        role.set(target)
    assert role.value == start and seen == [start]


def test_an_unknown_starting_role_is_refused() -> None:
    with pytest.raises(ValueError, match="must be one of"):
        LiveRole("both")
