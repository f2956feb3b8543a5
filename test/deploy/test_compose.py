"""docker/compose*.yaml: valid against the Compose specification's JSON schema (the copy that
check-jsonschema vendors, so the check runs offline) and wired the way one node needs: every
server healthy before the router starts, disjoint GPUs, memlock, shared memory, the secret
from the env file only."""

from __future__ import annotations

import json
from importlib import resources

import jsonschema
import pytest
from deploy_files import COMPOSE_FILES, DOCKER, compose_interpolate, load_compose

TOKEN_ENV = "PDSERVE_DISAGGREGATION_AUTH_TOKEN"


def compose_schema() -> dict:
    """The Compose specification's schema (compose-spec/compose-spec, schema/compose-spec.json),
    as the check-jsonschema package vendors it."""
    text = resources.files("check_jsonschema") / "builtin_schemas" / "vendor" / "compose-spec.json"
    return json.loads(text.read_text())


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_compose_files_match_the_compose_schema(path):
    schema = compose_schema()
    errors = sorted(jsonschema.validators.validator_for(schema)(schema).iter_errors(load_compose(path)),
                    key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{path.name}: {'.'.join(map(str, e.path))}: {e.message}" for e in errors)


def test_the_schema_check_rejects_a_broken_file():
    schema = compose_schema()
    broken = {"services": {"router": {"image": "pdserve", "depends_on": {"prefill": {"condition": "started"}}}}}
    assert list(jsonschema.validators.validator_for(schema)(schema).iter_errors(broken))


def _arg(command: list, flag: str) -> str:
    return command[command.index(flag) + 1]


@pytest.fixture(scope="module")
def services():
    return load_compose(DOCKER / "compose.yaml")["services"]


def servers(services):
    return {n: s for n, s in services.items() if s["command"][0] == "serve"}


def test_one_prefill_several_decodes_and_a_router(services):
    modes = sorted(_arg(s["command"], "--disaggregation-mode") for s in servers(services).values())
    assert modes.count("prefill") == 1 and modes.count("decode") >= 2
    assert services["router"]["command"][0] == "router"


def test_servers_have_their_own_gpus_memlock_shm_and_the_env_file(services):
    gpus = []
    for name, s in servers(services).items():
        gpus += s["environment"]["CUDA_VISIBLE_DEVICES"].split(",")
        assert "IPC_LOCK" in s["cap_add"] and s["ulimits"]["memlock"] == -1, name
        assert s["shm_size"] and s["network_mode"] == "host", name
        assert s["env_file"] == [{"path": "pdserve.env", "required": True}], name
        assert _arg(s["command"], "--device") == "cuda", name
    assert len(gpus) == len(set(gpus)), f"GPUs shared between servers: {gpus}"


def test_the_router_starts_after_every_server_is_healthy_and_routes_to_them(services):
    router = services["router"]
    assert router["depends_on"] == {n: {"condition": "service_healthy"} for n in servers(services)}
    cmd = [compose_interpolate(str(a), "router") for a in router["command"]]
    for name, s in servers(services).items():
        port = _arg(s["command"], "--port")
        assert s["healthcheck"]["test"][-1] == f"http://127.0.0.1:{port}/health", name
        url = f"http://127.0.0.1:{port}"
        if _arg(s["command"], "--disaggregation-mode") == "prefill":
            assert _arg(cmd, "--prefill") == url and cmd[cmd.index("--prefill") + 2] == \
                _arg(s["command"], "--disaggregation-bootstrap-port")
        else:
            assert url in [cmd[i + 1] for i, a in enumerate(cmd) if a == "--decode"], name


def test_rdma_override_names_only_services_of_the_main_file(services):
    rdma = load_compose(DOCKER / "compose.rdma.yaml")["services"]
    assert set(rdma) == set(servers(services))
    assert all(s["devices"] == ["/dev/infiniband:/dev/infiniband"] for s in rdma.values())


def test_the_token_comes_from_the_env_file_only():
    for path in COMPOSE_FILES:
        assert "auth-token" not in path.read_text(), path.name
    example = (DOCKER / "pdserve.env.example").read_text()
    assert f"\n{TOKEN_ENV}=" in example
    # the router listens on every interface: it refuses to start without the API key
    assert "\nPDSERVE_API_KEY=" in example and "\nPDSERVE_ADMIN_API_KEY=" in example
