"""Which interface gloo binds across nodes (distributed/groups.py): the one that reaches node 0,
never the host name's address by default (loopback on many hosts: the other nodes could not
connect). The two-host run itself is test/disagg/test_two_hosts.py."""

from __future__ import annotations

import pytest

from pdserve.distributed import groups


def test_the_interface_is_the_one_that_reaches_node_0():
    assert groups.route_source("127.0.0.1") == "127.0.0.1"
    assert groups.interface_of("127.0.0.1") == "lo"
    assert groups.gloo_interface("tcp://127.0.0.1:29500") == "lo"


def test_one_node_and_unknown_hosts_leave_gloo_alone():
    assert groups.gloo_interface("file:///tmp/store/dist_store") is None  # one node: gloo's own choice
    assert groups.gloo_interface("tcp://no-such-host.invalid:29500") is None
    assert groups.interface_of("192.0.2.254") is None  # TEST-NET-1: on no interface of a test machine


def test_pin_sets_the_variable_unless_the_operator_did(monkeypatch):
    monkeypatch.delenv(groups.GLOO_IFNAME_ENV, raising=False)
    groups.pin_gloo_interface("file:///tmp/x")
    assert groups.GLOO_IFNAME_ENV not in groups.os.environ
    groups.pin_gloo_interface("tcp://127.0.0.1:29500")
    assert groups.os.environ[groups.GLOO_IFNAME_ENV] == "lo"
    monkeypatch.setenv(groups.GLOO_IFNAME_ENV, "eth7")
    groups.pin_gloo_interface("tcp://127.0.0.1:29500")
    assert groups.os.environ[groups.GLOO_IFNAME_ENV] == "eth7"


def test_no_interface_found_is_said(monkeypatch, caplog):
    monkeypatch.delenv(groups.GLOO_IFNAME_ENV, raising=False)
    monkeypatch.setattr(groups, "gloo_interface", lambda method: None)
    with caplog.at_level("WARNING", logger=groups.__name__):
        groups.pin_gloo_interface("tcp://10.9.9.9:29500")
    assert groups.GLOO_IFNAME_ENV not in groups.os.environ
    assert "GLOO_SOCKET_IFNAME" in caplog.text and "10.9.9.9" in caplog.text


def test_ipv6_addresses_are_found_too():
    if groups.route_source("::1") is None:
        pytest.skip("no IPv6 loopback here")
    assert groups.interface_of("::1") == "lo"
