"""Every pdserve command in the deployment files parses with the CLI's own parser and passes the
checks its config makes, so a flag renamed or removed in the CLI fails here, not on a cluster."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io

import pytest
from deploy_files import (
    COMPOSE_FILES,
    DEPLOYMENT_DOC,
    DOCKERFILES,
    Command,
    compose_commands,
    doc_commands,
    dockerfile_commands,
    k8s_commands,
    kustomize_dirs,
)

from pdserve.assets import PRESET_NAMES
from pdserve.config import ServerArgs
from pdserve.entrypoints.cli import build_parser, router_args_from_namespace, server_args_from_namespace
from pdserve.entrypoints.up import UpArgs

SERVER_FIELDS = {f.name for f in dataclasses.fields(ServerArgs)}


def all_commands() -> list[Command]:
    out = [c for path in DOCKERFILES for c in dockerfile_commands(path)]
    out += [c for path in COMPOSE_FILES for c in compose_commands(path)]
    out += [c for d in kustomize_dirs() for c in k8s_commands(d)]
    return out + doc_commands()


def check(command: Command, parser: argparse.ArgumentParser) -> None:
    """Parse ``command`` as ``pdserve`` would, then build the config it would run with."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            ns = parser.parse_args(list(command.argv))
    except SystemExit:
        raise AssertionError(f"{command.source}: pdserve refuses {' '.join(command.argv)}:\n"
                             f"{err.getvalue().strip()}") from None
    # argparse also takes a unique prefix of a flag: a flag renamed to a longer name would still
    # parse, so every flag must be spelled exactly as the CLI defines it.
    known = _subparser(parser, ns.command)._option_string_actions
    inexact = [a for a in command.argv if a.startswith("--") and a.split("=", 1)[0] not in known]
    if inexact:
        raise AssertionError(f"{command.source}: pdserve {ns.command} has no flag {', '.join(inexact)}")
    try:
        if ns.command in ("serve", "up") and ns.model_path in PRESET_NAMES:
            server_args_from_namespace(ns)  # and against the model: head and expert counts vs TP/EP
        elif ns.command in ("serve", "up"):  # a checkpoint mounted at run time: the flags alone
            ServerArgs(**{k: v for k, v in vars(ns).items() if k in SERVER_FIELDS})
        if ns.command == "up":
            UpArgs(ns.num_prefill, ns.num_decode, ns.host, ns.port)
        if ns.command == "router":
            router_args_from_namespace(ns)
    except ValueError as e:
        raise AssertionError(f"{command.source}: {e}") from None


def test_the_files_hold_the_commands_this_test_is_for():
    sources = " ".join(c.source for c in all_commands())
    for where in ("Dockerfile.cpu", "compose.yaml", "k8s/base", "two-node-decode", "cpu-tiny", DEPLOYMENT_DOC.name):
        assert where in sources, f"no pdserve command found in {where}"
    subcommands = {c.argv[0] for c in all_commands() if c.argv}
    assert {"serve", "router", "up"} <= subcommands


@pytest.mark.parametrize("command", all_commands(), ids=lambda c: c.source)
def test_every_pdserve_command_parses_with_the_cli(command):
    check(command, build_parser())


def _subparser(parser: argparse.ArgumentParser, subcommand: str) -> argparse.ArgumentParser:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[subcommand]


def _renamed(parser: argparse.ArgumentParser, subcommand: str, old: str, new: str) -> argparse.ArgumentParser:
    """``parser`` with one flag of ``subcommand`` renamed, as a CLI change would rename it."""
    sub = _subparser(parser, subcommand)
    action = sub._option_string_actions.pop(old)
    action.option_strings = [new]
    sub._option_string_actions[new] = action
    return parser


@pytest.mark.parametrize("subcommand,flag,new", [
    ("serve", "--tp-size", "--tensor-parallel-size"),
    ("serve", "--disaggregation-bootstrap-port", "--disaggregation-bootstrap-port-base"),  # old is a prefix
    ("router", "--prefill", "--prefill-worker"),
    ("up", "--model-path", "--model"),
])
def test_a_renamed_flag_fails_the_check(subcommand, flag, new):
    parser = _renamed(build_parser(), subcommand, flag, new)
    users = [c for c in all_commands() if c.argv and c.argv[0] == subcommand and flag in c.argv]
    assert users, f"no deployment command uses {subcommand} {flag}"
    for command in users:
        with pytest.raises(AssertionError, match="unrecognized arguments|ambiguous option|required|has no flag"):
            check(command, parser)


@pytest.mark.parametrize("argv,field", [
    (("serve", "--model-path", "/models/model", "--tp-size", "8", "--ep-size", "4"), "ep_size"),
    (("serve", "--model-path", "tiny-deepseek", "--tp-size", "8"), "tp_size"),  # 4 heads
    (("router", "--prefill", "ftp://p", "--decode", "http://d:1"), "prefill"),
])
def test_an_invalid_combination_fails_the_check(argv, field):
    with pytest.raises(AssertionError, match=field):
        check(Command("here", argv), build_parser())
