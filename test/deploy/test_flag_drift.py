"""Every pdserve command in the deployment files (Dockerfiles, compose files, Kubernetes manifests)
parses with the CLI's own parser and passes the checks its config makes, so a flag renamed or removed
in the CLI fails here, not on a cluster. (The docs' commands: test_doc_commands.py.)"""

from __future__ import annotations

import pytest
from cli_check import check, pending_flags, renamed
from deploy_files import (
    COMPOSE_FILES,
    DOCKERFILES,
    Command,
    compose_commands,
    dockerfile_commands,
    k8s_commands,
    kustomize_dirs,
)

from pdserve.entrypoints.cli import build_parser


def all_commands() -> list[Command]:
    out = [c for path in DOCKERFILES for c in dockerfile_commands(path)]
    out += [c for path in COMPOSE_FILES for c in compose_commands(path)]
    return out + [c for d in kustomize_dirs() for c in k8s_commands(d)]


def test_the_files_hold_the_commands_this_test_is_for():
    sources = " ".join(c.source for c in all_commands())
    for where in ("Dockerfile.cpu", "compose.yaml", "k8s/base", "two-node-decode", "cpu-tiny"):
        assert where in sources, f"no pdserve command found in {where}"
    subcommands = {c.argv[0] for c in all_commands() if c.argv}
    assert {"serve", "router", "up"} <= subcommands


@pytest.mark.parametrize("command", [pending_flags(c) for c in all_commands()], ids=lambda c: c.source)
def test_every_pdserve_command_parses_with_the_cli(command):
    check(command, build_parser())


@pytest.mark.parametrize("subcommand,flag,new", [
    ("serve", "--tp-size", "--tensor-parallel-size"),
    ("serve", "--disaggregation-bootstrap-port", "--disaggregation-bootstrap-port-base"),  # old is a prefix
    ("router", "--prefill", "--prefill-worker"),
    ("up", "--model-path", "--model"),
])
def test_a_renamed_flag_fails_the_check(subcommand, flag, new):
    parser = renamed(build_parser(), subcommand, flag, new)
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
