"""Every command block of docs/deployment.md and docs/disaggregation.md runs through the CLIs'
parsers (nothing is started): each ``pdserve ...``, ``python -m pdserve...``, ``docker run IMAGE
ARGS`` (its pdserve args), ``python -m sglang_router.launch_router ...`` and ``mooncake_master ...``
command, with the variables the doc set before it (``VAR=value``, ``export``) expanded and in its
environment. pdserve's commands also build the config they would run with, except where the doc
elides a value (``...``). A flag renamed or removed in a CLI fails here, not for a reader."""

from __future__ import annotations

import shutil

import pytest
from cli_check import check, pending_flags, renamed
from deploy_files import COMMAND_DOCS, Command, doc_commands

from pdserve.entrypoints.cli import build_parser


def all_commands() -> list[Command]:
    return [c for doc in COMMAND_DOCS for c in doc_commands(doc)]


def _runnable(command: Command):
    if command.program == "mooncake_master" and not shutil.which("mooncake_master"):
        return pytest.param(command, marks=pytest.mark.skip(reason="no mooncake_master (the Mooncake wheel's) here"))
    return pending_flags(command)


def test_the_docs_hold_the_commands_this_test_is_for():
    by_doc = {doc.name: {c.argv[0] for c in doc_commands(doc) if c.program == "pdserve" and c.argv}
              for doc in COMMAND_DOCS}
    assert {"serve", "router", "up"} <= by_doc["disaggregation.md"], by_doc
    assert {"serve", "router", "bench", "plan"} <= by_doc["deployment.md"], by_doc
    assert any(c.program == "sglang-router" for c in all_commands())


@pytest.mark.parametrize("command", [_runnable(c) for c in all_commands()], ids=lambda c: c.source)
def test_every_doc_command_parses_with_its_cli(command):
    check(command)


@pytest.mark.parametrize("subcommand,flag,new", [
    ("serve", "--disaggregation-mode", "--disagg-mode"),
    ("serve", "--model-path", "--model"),
    ("router", "--port", "--listen-port"),
])
def test_a_renamed_flag_fails_the_doc_check(subcommand, flag, new):
    users = [c for c in all_commands() if c.program == "pdserve" and c.argv[:1] == (subcommand,) and flag in c.argv]
    assert {c.source.split(":", 1)[0] for c in users} == {doc.name for doc in COMMAND_DOCS}, users
    for command in users:
        with pytest.raises(AssertionError, match="unrecognized arguments|ambiguous option|required|has no flag"):
            check(command, renamed(build_parser(), subcommand, flag, new))


def test_a_misspelled_sglang_router_flag_fails_the_doc_check():
    """argparse would take ``--pd-disagg`` as a prefix of ``--pd-disaggregation``: the check does not."""
    users = [c for c in all_commands() if c.program == "sglang-router" and "--pd-disaggregation" in c.argv]
    assert users
    for command in users:
        broken = tuple("--pd-disagg" if a == "--pd-disaggregation" else a for a in command.argv)
        with pytest.raises(AssertionError, match="has no flag"):
            check(Command(command.source, broken, command.program, command.env))
