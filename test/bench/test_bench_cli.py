"""`pdserve bench` / `pdserve plan` argument handling: bad flags exit 2 naming the flag, no traceback."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from pdserve.bench.config import BenchConfig
from pdserve.entrypoints.cli import add_bench_args, bench_config_from_namespace, build_parser, main
from server_utils import free_port


def parse(*argv: str) -> BenchConfig:
    return bench_config_from_namespace(build_parser().parse_args(["bench", *argv]))


def test_flags_land_in_the_config():
    cfg = parse("--backend", "openai-chat", "--base-url", "http://h:1/", "--dataset-name", "mixed",
                "--num-prompts", "7", "--request-rate", "2.5", "--burstiness", "0.5", "--max-concurrency", "3",
                "--slo", "ttft:200,tpot:50", "--metric-percentiles", "50,99.9", "--mixed-background-rate", "0.25",
                "--extra-request-body", '{"top_k": 1}', "--seed", "9")
    assert cfg.endpoint.backend == "openai-chat" and cfg.endpoint.url == "http://h:1"
    assert cfg.endpoint.extra_request_body == {"top_k": 1}
    assert (cfg.load.num_prompts, cfg.load.request_rate, cfg.load.burstiness, cfg.load.max_concurrency,
            cfg.load.seed) == (7, 2.5, 0.5, 3, 9)
    assert cfg.report.slo == {"ttft": 200.0, "tpot": 50.0} and cfg.report.metric_percentiles == (50.0, 99.9)
    assert cfg.dataset.dataset_name == "mixed" and cfg.dataset.mixed_background_rate == 0.25
    assert parse("--goodput", "ttft:1", "e2el:9").report.slo == {"ttft": 1.0, "e2e": 9.0}  # vLLM's spelling


def test_defaults_are_the_dataclass_defaults():
    assert parse() == BenchConfig()


@pytest.mark.parametrize("argv,flag", [
    (["--slo", "speed:1"], "--slo"),
    (["--random-range-ratio", "2"], "--random-range-ratio"),
    (["--backend", "openai", "--tokenize-prompt"], "--tokenize-prompt"),
    (["--dataset-name", "sharegpt"], "--dataset-path"),
    (["--extra-request-body", "[1]"], "--extra-request-body"),
    (["--num-prompts", "0"], "--num-prompts"),
    (["--metric-percentiles", "50,100"], "--metric-percentiles"),
    (["--profile", "decode", "--profile-output-len", "2"], "--profile-output-len"),
])
def test_bad_bench_flags_exit_2_naming_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and "Traceback" not in err


def test_unreachable_server_is_a_clear_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "--base-url", f"http://127.0.0.1:{free_port()}", "--disable-tqdm"])
    assert e.value.code == 1 and "/v1/models" in capsys.readouterr().err


def test_bad_plan_inputs_exit_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "--prefill-profile", str(tmp_path / "none.json"), "--decode-profile", "x", "--slo", "ttft:1"])
    assert e.value.code == 2 and "--prefill-profile" in capsys.readouterr().err


def test_module_entry_point_is_the_bench_command():
    out = subprocess.run([sys.executable, "-m", "pdserve.bench_serving", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "--random-input-len" in out.stdout and "--slo" in out.stdout
    top = subprocess.run([sys.executable, "-m", "pdserve", "--help"], capture_output=True, text=True, timeout=120)
    assert "bench" in top.stdout and "plan" in top.stdout


def test_every_bench_flag_describes_itself():
    """Every flag has a help string of its own (a copied one tells a reader nothing about the second flag)."""
    parser = argparse.ArgumentParser()
    add_bench_args(parser)
    flags = [a for a in parser._actions if a.option_strings]
    assert all(a.help for a in flags)
    by_text: dict[str, list[str]] = {}
    for a in flags:
        by_text.setdefault(a.help, []).append(a.option_strings[0])
    assert {text: names for text, names in by_text.items() if len(names) > 1} == {}
    assert len(flags) > 40
