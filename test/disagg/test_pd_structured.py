"""Structured output and tool calls through P/D: one prefill and one decode (tiny-llama, random
weights, Mooncake over loopback), with ``pdserve router`` and the PyPI sglang-router both in front
of the pair, module-wide. The openai-client checks of the colocated test run through each router:
the grammar travels with the request to decode (prefill never samples and never compiles it), and
only the grammar can make these replies valid. Decode's received-KV count shows each request was
served disaggregated (decode's prefix cache is flushed before each check: a prompt it already holds
would need no transfer)."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys

import httpx
import openai
import pytest
from pd_servers import RoutedPair

from entrypoints.server_utils import free_port
from entrypoints.structured_checks import (
    check_ebnf,
    check_json_fuzz,
    check_json_schema,
    check_regex,
    check_required_tool_call,
)
from router.router_utils import wait_for

MODEL = "tiny-llama"
ROUTERS = ["pdserve", "sglang"]


@pytest.fixture(scope="module")
def pd():
    pair = RoutedPair(MODEL, "--max-total-tokens", "8192", "--num-threads", "1")
    try:
        yield pair.start()
    finally:
        pair.stop()


@pytest.fixture(scope="module")
def sglang_router(pd):
    if importlib.util.find_spec("sglang_router") is None:
        pytest.skip("sglang-router is not installed")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation", "--prefill", pd.prefill.url,
           str(pd.boot), "--decode", pd.decode.url, "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        probe = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        wait_for(lambda: _answers(url, probe, proc), 120, "sglang-router forwards requests")
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def _answers(url: str, body: dict, proc: subprocess.Popen) -> bool:
    assert proc.poll() is None, f"sglang-router exited with {proc.returncode}"
    try:
        return httpx.post(url + "/v1/chat/completions", json=body, timeout=60).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(params=ROUTERS)
def client(request, pd):
    url = pd.router.url if request.param == "pdserve" else request.getfixturevalue("sglang_router")
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=180)


def _disaggregated(pd, check, client) -> None:
    """Runs ``check``; its first request must take its KV from prefill. Decode's prefix cache is
    emptied first: a prompt decode already holds needs no transfer (and the checks repeat prompts)."""
    pd.decode.wait_idle()
    assert pd.decode.post("/flush_cache").status_code == 200
    before = pd.decode.info()["kv_received"]
    check(client, MODEL)
    assert pd.decode.info()["kv_received"] > before, "served by decode's local fallback, not through P/D"


def test_json_schema(pd, client):
    _disaggregated(pd, check_json_schema, client)


def test_required_tool_call(pd, client):
    _disaggregated(pd, check_required_tool_call, client)


def test_regex(pd, client):
    _disaggregated(pd, check_regex, client)


def test_ebnf(pd, client):
    _disaggregated(pd, check_ebnf, client)


def test_random_samples_are_strict_compact_json(pd, client):
    """Issue 32 through P/D: sampled json_schema replies, streamed and not, are strict compact JSON."""
    _disaggregated(pd, lambda c, m: check_json_fuzz(c, m, per_request=5), client)
