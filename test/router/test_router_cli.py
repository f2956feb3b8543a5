"""``pdserve router`` flags -> RouterArgs (sglang-router's shape), and bad flags exit 2 naming the field."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdserve.entrypoints.cli import build_parser, router_args_from_namespace
from pdserve.router.config import PrefillSpec, RouterArgs


def parse(*argv: str) -> RouterArgs:
    return router_args_from_namespace(build_parser().parse_args(["router", *argv]))


def test_flags_map_to_router_args():
    args = parse("--prefill", "http://10.0.0.1:30000", "9000", "--prefill", "http://10.0.0.2:30000/",
                 "--decode", "http://10.0.0.3:30001", "--decode", "http://10.0.0.4:30001",
                 "--host", "0.0.0.0", "--port", "8000", "--policy", "round_robin", "--decode-policy", "least_load",
                 "--health-check-interval-secs", "2", "--health-check-timeout-secs", "1",
                 "--worker-startup-timeout-secs", "30", "--worker-startup-check-interval", "0.5",
                 "--request-timeout-secs", "60", "--log-level", "debug")
    assert args == RouterArgs(
        prefill=(PrefillSpec("http://10.0.0.1:30000", 9000), PrefillSpec("http://10.0.0.2:30000", 8998)),
        decode=("http://10.0.0.3:30001", "http://10.0.0.4:30001"), host="0.0.0.0", port=8000,
        policy="round_robin", decode_policy="least_load", health_check_interval_secs=2.0,
        health_check_timeout_secs=1.0, worker_startup_timeout_secs=30.0, worker_startup_check_interval=0.5,
        request_timeout_secs=60.0, log_level="debug")
    assert (args.prefill_policy_name, args.decode_policy_name) == ("round_robin", "least_load")


def test_defaults():
    args = parse("--prefill", "http://p:1", "--decode", "http://d:2")
    assert args == RouterArgs(prefill=(PrefillSpec("http://p:1", 8998),), decode=("http://d:2",))
    assert args.policy == "cache_aware" and args.health_check_interval_secs == 5.0
    assert (args.balance_abs_threshold, args.balance_rel_threshold) == (64, 1.5)  # sglang-router's
    assert args.approximate_index  # cache_aware guesses each prefill's cache unless told not to
    assert not parse("--prefill", "http://p:1", "--decode", "http://d:2", "--no-approximate-index").approximate_index


def test_fleet_flags_map_to_router_args():
    """sglang-router's names for breakers, retries, the cap, health thresholds and discovery."""
    args = parse("--cb-failure-threshold", "4", "--cb-success-threshold", "1", "--cb-timeout-duration-secs", "7",
                 "--retry-max-retries", "2", "--retry-initial-backoff-ms", "10", "--retry-max-backoff-ms", "100",
                 "--retry-backoff-multiplier", "2", "--retry-jitter-factor", "0.5", "--disable-retries",
                 "--max-concurrent-requests", "8", "--queue-size", "3", "--queue-timeout-secs", "9",
                 "--health-failure-threshold", "5", "--health-success-threshold", "4",
                 "--health-check-endpoint", "/health_generate", "--disable-circuit-breaker",
                 "--service-discovery", "--selector", "app=pdserve", "--prefill-selector", "role=prefill",
                 "tier=a", "--decode-selector", "role=decode", "--service-discovery-namespace", "llm",
                 "--service-discovery-port", "30000", "--bootstrap-port-annotation", "x/bootstrap",
                 "--workers-file", "/etc/pdserve/workers.yaml")
    assert args == RouterArgs(
        prefill=(), decode=(), cb_failure_threshold=4, cb_success_threshold=1, cb_timeout_duration_secs=7.0,
        retry_max_retries=2, retry_initial_backoff_ms=10, retry_max_backoff_ms=100, retry_backoff_multiplier=2.0,
        retry_jitter_factor=0.5, disable_retries=True, max_concurrent_requests=8, queue_size=3,
        queue_timeout_secs=9.0, health_failure_threshold=5, health_success_threshold=4,
        health_check_endpoint="/health_generate", disable_circuit_breaker=True, service_discovery=True,
        selector=("app=pdserve",), prefill_selector=("role=prefill", "tier=a"), decode_selector=("role=decode",),
        service_discovery_namespace="llm", service_discovery_port=30000, bootstrap_port_annotation="x/bootstrap",
        workers_file="/etc/pdserve/workers.yaml")
    defaults = parse("--prefill", "http://p:1", "--decode", "http://d:2")
    assert (defaults.cb_failure_threshold, defaults.cb_success_threshold, defaults.cb_timeout_duration_secs) == \
        (10, 3, 60.0)  # sglang-router's
    assert (defaults.retry_max_retries, defaults.retry_initial_backoff_ms, defaults.retry_max_backoff_ms,
            defaults.retry_backoff_multiplier, defaults.retry_jitter_factor) == (5, 50, 30_000, 1.5, 0.2)
    assert (defaults.health_failure_threshold, defaults.health_success_threshold) == (3, 1)
    assert (defaults.max_concurrent_requests, defaults.queue_size, defaults.queue_timeout_secs) == (-1, 100, 60.0)
    assert defaults.bootstrap_port_annotation == "sglang.ai/bootstrap-port" and not defaults.discovers


P, D = ["--prefill", "http://p:1"], ["--decode", "http://d:2"]


@pytest.mark.parametrize("argv,message", [
    (["--prefill", "http://p:1", "x", *D], "prefill http://p:1: bootstrap_port must be an integer port, got 'x'"),
    (["--prefill", "http://p:1", "70000", *D], "prefill http://p:1: bootstrap_port: must be in 1..65535"),
    (["--prefill", "http://p:1", "1", "2", *D], "prefill: expected URL [BOOTSTRAP_PORT]"),
    (["--prefill", "p:1", *D], "prefill: 'p:1' is not an http(s)://HOST[:PORT] URL"),
    (["--prefill", "http://p:1/v1", *D], "prefill: 'http://p:1/v1' must be a server's base URL"),
    ([*P, "--decode", "http://d:99999"], "decode: 'http://d:99999' has an invalid port"),
    ([*P, *D, *D], "decode: http://d:2 is listed twice"),
    ([*P, *D, "--port", "0"], "port: must be in 1..65535, got 0"),
    ([*P, *D, "--health-check-interval-secs", "0"], "health_check_interval_secs: must be > 0"),
    (D, "prefill: give at least one --prefill URL [BOOTSTRAP_PORT] (or --service-discovery, or --workers-file)"),
    ([*P, *D, "--cb-failure-threshold", "0"], "cb_failure_threshold: must be >= 1, got 0"),
    ([*P, *D, "--health-success-threshold", "0"], "health_success_threshold: must be >= 1, got 0"),
    ([*P, *D, "--retry-jitter-factor", "2"], "retry_jitter_factor: must be in [0, 1], got 2.0"),
    ([*P, *D, "--retry-max-backoff-ms", "10"], "retry_max_backoff_ms: must be >= retry_initial_backoff_ms (50)"),
    ([*P, *D, "--retry-backoff-multiplier", "0.5"], "retry_backoff_multiplier: must be >= 1.0"),
    ([*P, *D, "--max-concurrent-requests", "0"], "max_concurrent_requests: must be >= 1 (or -1: no cap), got 0"),
    ([*P, *D, "--queue-size", "-1"], "queue_size: must be >= 0, got -1"),
    ([*P, *D, "--queue-timeout-secs", "0"], "queue_timeout_secs: must be > 0"),
    ([*P, *D, "--health-check-endpoint", "health"], "health_check_endpoint: must be a path starting with '/'"),
    (["--service-discovery", "--decode-selector", "role=decode"],
     "prefill_selector: --service-discovery needs --prefill-selector and --decode-selector"),
    (["--service-discovery", "--prefill-selector", "role", "--decode-selector", "role=decode"],
     "prefill_selector: 'role' is not a key=value label"),
    (["--service-discovery", "--prefill-selector", "a=b", "--decode-selector", "c=d", "--service-discovery-port",
      "0"], "service_discovery_port: must be in 1..65535, got 0"),
    # a labelled pod in any namespace would get the worker key and the prompts
    (["--service-discovery", "--prefill-selector", "a=b", "--decode-selector", "c=d"],
     "service_discovery_namespace: --service-discovery needs the namespace"),
])
def test_bad_values_name_the_field(argv, message):
    with pytest.raises(ValueError) as e:
        parse(*argv)
    assert message in str(e.value)


def _run(*argv: str, module: str = "pdserve") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *argv], capture_output=True, text=True, timeout=120)


def test_cli_exits_2_naming_the_field():
    proc = _run("router", "--prefill", "http://p:1", "abc", "--decode", "http://d:2")
    assert proc.returncode == 2
    assert "bootstrap_port must be an integer port" in proc.stderr and "Traceback" not in proc.stderr
    proc = _run("router", "--prefill", "http://p:1")  # --decode is required
    assert proc.returncode == 2 and "--decode" in proc.stderr
    proc = _run("--policy", "prefix", "--prefill", "http://p:1", "--decode", "http://d:2",
                module="pdserve.router")
    assert proc.returncode == 2 and "prefix" in proc.stderr
    proc = _run("router", *P, *D, "--balance-rel-threshold", "0.5")
    assert proc.returncode == 2 and "balance_rel_threshold: must be >= 1.0" in proc.stderr


def test_both_entry_points_show_the_router_flags():
    for out in (_run("router", "--help").stdout, _run("--help", module="pdserve.router").stdout):
        for flag in ("--prefill URL [BOOTSTRAP_PORT", "--decode URL", "--prefill-policy", "--decode-policy",
                     "--health-check-interval-secs", "--worker-startup-timeout-secs", "--cb-failure-threshold",
                     "--retry-max-retries", "--max-concurrent-requests", "--health-failure-threshold",
                     "--service-discovery", "--prefill-selector", "--bootstrap-port-annotation", "--workers-file"):
            assert flag in out
