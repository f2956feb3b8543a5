"""What README.md and the docs name, checked against the code, so a doc cannot drift from it:

- every ``pdserve ...`` command of a shell block parses with the CLI, every flag spelled exactly, and
  builds the config it would run with (``cli_check.check``, as test_doc_commands.py does for
  deployment.md and disaggregation.md, the docs it covers); a model path is a built-in preset or a
  filesystem path, never a Hugging Face id (the server loads local directories only); in inline code
  (``pdserve up --elastic``, a fragment), every flag is one of the subcommand's;
- every ``tiny-*`` model named is a built-in preset, and the README's ``--model-path`` row lists them all;
- every ``pdserve serve`` flag is in the README's flag table (or under a ``--family-*`` row there);
- every metric named (``pdserve:...``, ``pdserve_router:...``) is one the servers or the router expose.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from cli_check import check
from deploy_files import COMMAND_DOCS, ROOT, Command

from pdserve.assets import PRESET_NAMES
from pdserve.entrypoints.cli import build_parser
from pdserve.obs.metrics import (
    DISAGG_COUNTERS,
    DISAGG_GAUGES,
    HICACHE_COUNTERS,
    HICACHE_GAUGES,
    SPEC_COUNTERS,
    SPEC_GAUGES,
    STAT_GAUGES,
    ServerMetrics,
)
from pdserve.obs.timeline import ReqTimeline
from pdserve.router.metrics import RouterMetrics
from pdserve.router.workers import Role, WorkerSet

README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
SUBCOMMANDS = ("serve", "router", "up", "bench", "plan")
FENCE = re.compile(r"^```([\w-]*)\n(.*?)^```", re.M | re.S)
SHELL = ("", "bash", "sh", "shell", "console")
_SUB = "|".join(SUBCOMMANDS)
COMMAND = re.compile(rf"(?:^|&&|;|\|\||\$ )\s*(?:python3? -m )?(pdserve (?:{_SUB})\b[^\n;&|#]*)")
INLINE = re.compile(rf"`(pdserve (?:{_SUB}) [^`]*--[^`]*)`")
IMAGES = {p.name.split(".", 1)[1] for p in (ROOT / "docker").glob("Dockerfile.*")}  # pdserve:cpu is an image


def doc_pdserve_commands(path: Path) -> list[Command]:
    """The whole commands of the doc's shell blocks."""
    out = []
    for lang, body in FENCE.findall(path.read_text()):
        if lang in SHELL:
            for line in COMMAND.findall(body.replace("\\\n", " ")):
                words = shlex.split(line, comments=True)
                out.append(Command(f"{path.name}: {' '.join(words)}", tuple(words[1:]), "pdserve", ()))
    return out


def doc_inline_fragments(path: Path) -> list[tuple[str, list[str]]]:
    """(where, words after ``pdserve``) of each inline ``pdserve SUB --flag ...`` span."""
    return [(f"{path.name}: {span}", shlex.split(span)[1:]) for span in INLINE.findall(path.read_text())]


def _commands() -> list[Command]:
    return [c for doc in DOCS if doc not in COMMAND_DOCS for c in doc_pdserve_commands(doc)]


def _fragments() -> list[tuple[str, list[str]]]:
    return [f for doc in DOCS for f in doc_inline_fragments(doc)]


def test_the_docs_hold_commands_of_every_kind_this_test_is_for():
    subs = {c.argv[0] for c in _commands()}
    assert {"serve", "up", "router"} <= subs, subs
    assert any(c.source.startswith("structured-outputs.md") for c in _commands())


@pytest.mark.parametrize("command", _commands(), ids=lambda c: c.source[:120])
def test_every_doc_command_parses_and_names_a_loadable_model(command):
    check(command)
    argv = list(command.argv)
    if "--model-path" in argv:
        model = argv[argv.index("--model-path") + 1]
        assert model in PRESET_NAMES or model.startswith(("/", ".", "~", "$")) or model in ("M", "MODEL"), (
            f"{command.source}: --model-path {model} is neither a preset nor a path (the server refuses hub ids)")


@pytest.mark.parametrize("where, words", _fragments(), ids=lambda f: f if isinstance(f, str) else "")
def test_every_inline_command_names_flags_of_its_subcommand(where, words):
    sub = build_parser()._subparsers._group_actions[0].choices[words[0]]  # noqa: SLF001 - argparse's own
    unknown = [w for w in words[1:] if w.startswith("--") and w.split("=", 1)[0] not in sub._option_string_actions]  # noqa: SLF001
    assert not unknown, f"{where}: pdserve {words[0]} has no flag {', '.join(unknown)}"


def test_a_hub_id_fails_the_model_check():
    bad = Command("x.md: pdserve serve --model-path Qwen/Qwen2.5-7B-Instruct", ("serve", "--model-path",
                                                                             "Qwen/Qwen2.5-7B-Instruct"), "pdserve", ())
    with pytest.raises(AssertionError, match="neither a preset nor a path"):
        test_every_doc_command_parses_and_names_a_loadable_model(bad)


def test_every_preset_named_exists_and_the_readme_lists_them_all():
    named = {m for doc in DOCS for m in re.findall(r"\btiny-[a-z0-9]+(?:-[a-z0-9]+)*", doc.read_text())}
    assert named <= set(PRESET_NAMES), named - set(PRESET_NAMES)
    (row,) = [line for line in README.read_text().splitlines() if line.startswith("| `--model-path`")]
    assert set(re.findall(r"`(tiny-[a-z0-9-]+)`", row)) == set(PRESET_NAMES), row


def test_every_serve_flag_is_in_the_readme_table():
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # noqa: SLF001 - argparse's own
    flags = {o for a in serve._actions for o in a.option_strings if o.startswith("--")} - {"--help"}  # noqa: SLF001
    table = "\n".join(line for line in README.read_text().splitlines() if line.startswith("| `--"))
    families = re.findall(r"`(--[a-z-]+-)\*`", table)
    missing = {f for f in flags if f"`{f}`" not in table and not any(f.startswith(p) for p in families)}
    assert not missing, sorted(missing)


def _exposed_server_metrics() -> set[str]:
    m = ServerMetrics("m")
    stats = {k: 1 for table in (STAT_GAUGES, DISAGG_COUNTERS, DISAGG_GAUGES, HICACHE_COUNTERS, HICACHE_GAUGES,
                                 SPEC_COUNTERS, SPEC_GAUGES) for k in table}
    figures = {"requests": 1, "compile_seconds": {"bounds": [1.0], "counts": [1, 0], "sum": 0.5},
               "mask_seconds": {"bounds": [1.0], "counts": [1, 0], "sum": 0.5}}
    stats.update(cache_hit_tokens_device=1, grammar=figures, grammar_frontend=figures, num_grammar_queue_reqs=0,
                 control_refused_by_reason={"auth": 1})
    m.set_scheduler_stats(stats)
    m.set_role("decode")
    m.observe_role_switch("prefill", "done")
    timeline = ReqTimeline()
    m.observe_finished(timeline, 1, 1, "stop")
    return _names(m.render().decode())


def _names(exposition: str) -> set[str]:
    out = set()
    for line in exposition.splitlines():
        if line.startswith("# TYPE "):
            name, kind = line.split()[2:4]
            out.add(name)
            out |= {name + s for s in ("_total", "_created")} if kind == "counter" else set()
            out |= {name + s for s in ("_bucket", "_sum", "_count")} if kind == "histogram" else set()
        elif line and not line.startswith("#"):
            out.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return out


def test_every_metric_named_in_the_docs_is_exposed():
    no_workers = [WorkerSet(Role.PREFILL, [], None), WorkerSet(Role.DECODE, [], None)]  # type: ignore[arg-type]
    exposed = _exposed_server_metrics() | _names(RouterMetrics().render(no_workers).decode())
    named = {m for doc in DOCS for m in re.findall(r"\bpdserve(?:_router)?:[a-z_0-9]+", doc.read_text())}
    named = {m for m in named if m.split(":", 1)[1] not in IMAGES}
    assert named, "no metric named in the docs: the check checks nothing"
    assert not named - exposed, sorted(named - exposed)


def test_a_misnamed_counter_fails_the_metric_check():
    exposed = _exposed_server_metrics()
    assert "pdserve:spec_accepted_tokens_total" in exposed and "pdserve:spec_accepted_tokens" not in exposed
