"""What a person sees when ``pdserve`` refuses a flag or is stopped while it starts: one line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from pdserve.entrypoints import cli


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve", *argv], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("argv,names", [
    (("router", "--port", "x"), ("pdserve router", "--port", "'x'")),
    (("serve", "--model-path", "tiny-llama", "--page-size", "q"), ("pdserve serve", "--page-size", "'q'")),
    (("up", "--model-path", "tiny-llama", "--num-prefill", "many"), ("pdserve up", "--num-prefill")),
    (("bench", "--request-rate", "fast"), ("pdserve bench", "--request-rate")),
    (("router", "--policy", "nearest"), ("pdserve router", "--policy", "nearest")),
])
def test_a_bad_flag_value_is_one_line_naming_the_flag_and_the_command(argv, names):
    proc = _run(*argv)
    assert proc.returncode == 2
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert all(n in lines[0] for n in names), lines[0]


def test_ctrl_c_in_a_command_is_one_line(monkeypatch, capsys):
    def interrupted(ns, parser):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_router", interrupted)
    assert cli.main(["router", "--prefill", "http://p:1", "--decode", "http://d:2"]) == 130
    assert capsys.readouterr().err == "pdserve router: interrupted\n"


def test_ctrl_c_during_start_up_is_one_line(tmp_path):
    """A server stopped while it reads its token file (a FIFO, so it waits there until told)."""
    fifo = tmp_path / "token"
    os.mkfifo(fifo)
    proc = subprocess.Popen([sys.executable, "-m", "pdserve", "serve", "--model-path", "tiny-llama",
                             "--disaggregation-auth-token-file", str(fifo)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    writer = None
    try:
        deadline = time.monotonic() + 120
        while writer is None:  # a FIFO opens for writing without blocking only once a reader has it
            try:
                writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stderr
                time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        err = proc.communicate(timeout=60)[1]
    finally:
        if writer is not None:
            os.close(writer)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130
    assert err == "pdserve serve: interrupted\n"
