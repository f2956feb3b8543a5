"""One command of a deployment file or a doc, checked the way its program would take it: parsed by
the program's own argument parser (nothing is started), every flag spelled exactly, then for pdserve
the config it would run with built and checked. Used by test_flag_drift.py and test_doc_commands.py."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Iterator
from functools import cache

import torch
from deploy_files import Command

from pdserve.assets import PRESET_NAMES
from pdserve.config import ServerArgs
from pdserve.entrypoints.cli import build_parser, router_args_from_namespace, server_args_from_namespace
from pdserve.entrypoints.up import UpArgs

SERVER_FIELDS = {f.name for f in dataclasses.fields(ServerArgs)}
# A value a doc leaves out on purpose (`--prefill ...`): the command is parsed, its config not built.
ELIDED = "..."


@contextlib.contextmanager
def environment(env: tuple[tuple[str, str], ...]) -> Iterator[None]:
    """``os.environ`` with the command's variables (a doc's ``export``), for as long as it is checked."""
    saved = dict(os.environ)
    os.environ.update(dict(env))
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def parse(parser: argparse.ArgumentParser, command: Command, sub: str | None) -> argparse.Namespace:
    """argparse's verdict, and no flag spelled as a mere prefix of the parser's (argparse takes a unique
    prefix, so a flag renamed to a longer name would still parse)."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            ns = parser.parse_args(list(command.argv))
    except SystemExit:
        raise AssertionError(f"{command.source}: {command.program} refuses {' '.join(command.argv)}:\n"
                             f"{err.getvalue().strip()}") from None
    known = (subparser(parser, ns.command) if sub is None else parser)._option_string_actions
    inexact = [a for a in command.argv if a.startswith("--") and a.split("=", 1)[0] not in known]
    if inexact:
        raise AssertionError(f"{command.source}: {command.program} {sub or ns.command} has no flag "
                             f"{', '.join(inexact)}")
    return ns


def check(command: Command, parser: argparse.ArgumentParser | Callable[[], argparse.ArgumentParser] = build_parser
          ) -> None:
    """``command`` as its program would take it (``parser``: pdserve's, or a factory of it)."""
    with environment(command.env):
        if command.program == "sglang-router":
            return check_sglang_router(command)
        if command.program == "mooncake_master":
            return check_mooncake_master(command)
        assert command.program == "pdserve", command
        ns = parse(parser if isinstance(parser, argparse.ArgumentParser) else parser(), command, None)
        if ELIDED not in command.argv:
            _check_config(command, ns)


def _check_config(command: Command, ns: argparse.Namespace) -> None:
    if getattr(ns, "device", None) == "cuda" and not torch.cuda.is_available():
        # Whether a GPU is visible is the host's, not the command's: this host checks the rest.
        ns = argparse.Namespace(**{**vars(ns), "device": "cpu"})
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


def check_sglang_router(command: Command) -> None:
    """sglang-router (the PyPI router the docs offer in front of pdserve): its own parser and args."""
    from sglang_router.router_args import RouterArgs

    parser = argparse.ArgumentParser(prog="sglang_router.launch_router")
    RouterArgs.add_cli_args(parser, use_router_prefix=False)
    ns = parse(parser, command, "launch_router")
    try:
        RouterArgs.from_cli_args(ns, use_router_prefix=False)
    except ValueError as e:
        raise AssertionError(f"{command.source}: {e}") from None


@cache
def mooncake_master_flags() -> frozenset[str]:
    out = subprocess.run([shutil.which("mooncake_master") or "mooncake_master", "--help"], capture_output=True,
                         text=True, timeout=60)
    return frozenset(re.findall(r"^\s+-(\w+) \(", out.stdout + out.stderr, re.M))


def check_mooncake_master(command: Command) -> None:
    """The master's gflags (``-name=value``) against its ``--help``."""
    known = mooncake_master_flags()
    assert "rpc_port" in known, "mooncake_master --help lists no flags"
    used = [a.lstrip("-").split("=", 1)[0] for a in command.argv if a.startswith("-")]
    unknown = [f for f in used if f not in known]
    if unknown:
        raise AssertionError(f"{command.source}: mooncake_master has no flag {', '.join(unknown)}")


def pending_flags(command: Command):
    """A pytest param of ``command``. The discovering router's commands use sglang-router's Kubernetes
    discovery flags, which ``pdserve router`` gains with the fleet work of issue 26: until it has them
    such a command must fail the check (strict), and once it has them it is checked like any other."""
    import pytest

    router_flags = subparser(build_parser(), "router")._option_string_actions
    if command.program == "pdserve" and "--service-discovery" in command.argv \
            and "--service-discovery" not in router_flags:
        return pytest.param(command, marks=pytest.mark.xfail(
            strict=True, raises=AssertionError, reason="pdserve router has no Kubernetes discovery flags yet"))
    return command


def subparser(parser: argparse.ArgumentParser, subcommand: str) -> argparse.ArgumentParser:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[subcommand]


def renamed(parser: argparse.ArgumentParser, subcommand: str, old: str, new: str) -> argparse.ArgumentParser:
    """``parser`` with one flag of ``subcommand`` renamed, as a CLI change would rename it."""
    sub = subparser(parser, subcommand)
    action = sub._option_string_actions.pop(old)
    action.option_strings = [new]
    sub._option_string_actions[new] = action
    return parser
