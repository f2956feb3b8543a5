"""Mooncake Store tier against a real ``mooncake_master`` subprocess (one per module, plus one killed)."""

import socket
from collections.abc import Callable, Iterator

import pytest

from pdserve.mem.storage import create_page_store
from pdserve.mem.storage.base import PageStore
from pdserve.mem.storage.keys import chunk_keys, namespace

mooncake_store = pytest.importorskip("pdserve.mem.storage.mooncake_store")
pytest.importorskip("mooncake.store")
MooncakeMaster = mooncake_store.MooncakeMaster
MooncakeStore = mooncake_store.MooncakeStore

NS = namespace({"model": "a", "dtype": "bfloat16", "page_size": 4})
OTHER_NS = namespace({"model": "b", "dtype": "bfloat16", "page_size": 4})
KEYS = chunk_keys(NS, list(range(2000)), 4)
SEGMENT = "32mb"  # the smallest size that set up reliably here (8 MiB was refused)


def page(i: int, size: int = 4096) -> bytes:
    return bytes([i % 251]) * size


@pytest.fixture(scope="module")
def master() -> Iterator[MooncakeMaster]:
    with MooncakeMaster() as m:
        yield m


@pytest.fixture
def open_store(master) -> Iterator[Callable[..., PageStore]]:
    opened: list[PageStore] = []

    def make(segment: str | int = SEGMENT, ns: bytes = NS, on=None, token: str | None = None, host: str = "127.0.0.1",
             **extra) -> PageStore:
        on = on or master
        config = {
            "master_server_address": on.address,
            "metadata_server": on.metadata_server,
            "global_segment_size": segment,
            "local_buffer_size": "16mb",
            **extra,
        }
        store = create_page_store("mooncake", directory=None, size_gb=1.0, namespace=ns, extra_config=config,
                                  auth_token=token, host=host)
        assert isinstance(store, MooncakeStore)
        opened.append(store)
        return store

    yield make
    for store in reversed(opened):
        store.close()


def test_two_clients_on_one_master_share_pages(open_store):
    owner = open_store()  # lends 32 MiB of this process
    client = open_store(segment=0)  # lends nothing: stores into the owner's segment
    assert client.put(KEYS[0], page(0)) and client.put(KEYS[1], page(1))
    assert client.put(KEYS[0], page(0))  # idempotent
    assert owner.exists(KEYS) == 2 and owner.exists(KEYS[1:]) == 1
    assert owner.get(KEYS[0]) == page(0) and owner.get(KEYS[1]) == page(1)
    assert owner.put(KEYS[2], page(2)) and client.get(KEYS[2]) == page(2)
    assert client.get(KEYS[3]) is None
    stats = owner.stats()
    assert stats["hits"] == 2 and stats["bytes_read"] == 2 * 4096 and stats["puts"] == 1
    assert client.stats()["miss_absent"] == 1 and client.stats()["puts"] == 3


def test_the_segment_is_registered_at_the_servers_host(open_store):
    """Other clients reach the memory a store lends at its ``local_hostname``: the server's --host
    by default (it was 127.0.0.1 whatever --host said, and a store on another host failed every read
    from it: test/disagg/test_two_hosts.py), a wildcard bind as this machine's address, and the
    extra config's value over both."""
    assert open_store(segment=0, host="127.0.0.1").config.local_hostname == "127.0.0.1"
    here = socket.gethostbyname(socket.gethostname())
    assert open_store(segment=0, host="0.0.0.0").config.local_hostname == here
    assert open_store(segment=0, host="0.0.0.0", local_hostname="127.0.0.1").config.local_hostname == "127.0.0.1"


def test_another_models_page_is_a_counted_miss_then_replaced(open_store):
    ours = open_store()
    theirs = open_store(segment=0, ns=OTHER_NS)
    key = KEYS[10]
    assert theirs.put(key, page(7))  # same key bytes, same shape, other compatibility record
    assert ours.get(key) is None and ours.stats()["wrong_namespace"] == 1
    assert ours.put(key, page(10)) and ours.get(key) == page(10)  # the bad object was removed


def test_under_a_token_a_page_put_without_it_is_a_counted_miss_then_replaced(open_store):
    """Any client of the master may put: a page without the deployment's MAC (or under another
    token) is a ``bad_mac`` miss, removed so that a signed put can take the key."""
    ours = open_store(token="deployment")
    planter = open_store(segment=0)  # same namespace and shape, no token
    guesser = open_store(segment=0, token="guessed")
    assert planter.put(KEYS[30], page(99)) and guesser.put(KEYS[31], page(98))
    assert ours.get(KEYS[30]) is None and ours.get(KEYS[31]) is None
    stats = ours.stats()
    assert (stats["bad_mac"], stats["misses"], stats["hits"]) == (2, 2, 0)
    assert ours.put(KEYS[30], page(30)) and ours.get(KEYS[30]) == page(30)
    assert planter.get(KEYS[30]) == page(30)  # a reader without a token checks the CRC only


def test_full_pool_is_a_put_failure_and_never_wrong_bytes(open_store):
    owner = open_store()
    big = 1 << 20
    results = [owner.put(k, page(i, big)) for i, k in enumerate(KEYS[20:60])]  # 40 MiB into 32 MiB
    assert not all(results) and any(results)
    stats = owner.stats()
    assert stats["put_failures"] == results.count(False) and stats["put_full"] >= 1
    for i, key in enumerate(KEYS[20:60]):
        assert owner.get(key) in (None, page(i, big))


def test_lost_segment_is_a_miss(open_store):
    owner = open_store()
    client = open_store(segment=0)
    assert client.put(KEYS[100], page(100))
    assert client.get(KEYS[100]) == page(100)
    owner.close()  # its segment, and every page in it, leaves the pool
    assert client.get(KEYS[100]) is None
    assert client.exists(KEYS[100:101]) == 0
    assert owner.get(KEYS[100]) is None and not owner.put(KEYS[101], page(1))  # closed
    assert owner.stats()["closed"] == 2


def test_owned_master_then_killed_gives_misses_and_put_failures():
    # start_master: the store starts (and owns) its master; killing it is a crash of the metadata service
    store = create_page_store(
        "mooncake",
        directory=None,
        size_gb=0.05,
        namespace=NS,
        extra_config={"start_master": True, "local_buffer_size": "16mb", "master_retry_s": 60},
    )
    assert isinstance(store, MooncakeStore)
    owned = store._master
    assert owned is not None and owned.alive()
    try:
        assert store.put(KEYS[200], page(0)) and store.get(KEYS[200]) == page(0)
        owned.kill()
        assert store.exists(KEYS[200:201]) == 0  # the first failed call marks the master down ...
        assert store.get(KEYS[200]) is None  # ... so these fail at once instead of retrying for seconds
        assert not store.put(KEYS[201], page(1))
        stats = store.stats()
        assert stats["master_errors"] >= 1 and stats["master_down"] == 2 and stats["put_failures"] == 1
    finally:
        store.close()
    assert not owned.alive() and store._master is None


@pytest.mark.parametrize(
    "extra, field",
    [
        ({}, "master_server_address"),
        ({"master_server_address": "127.0.0.1:1", "local_buffer_size": "lots"}, "local_buffer_size"),
        ({"master_server_address": "127.0.0.1:1", "protocl": "tcp"}, "protocl"),
        ({"master_server_address": "127.0.0.1:1", "start_master": True}, "not both"),
        ({"master_server_address": "127.0.0.1:1", "enable_ssd_offload": True}, "ssd_offload_path"),
        ({"master_server_address": "127.0.0.1:1", "master_retry_s": "1"}, "master_retry_s"),
    ],
)
def test_bad_extra_config_names_the_field(extra, field):
    with pytest.raises(ValueError, match=field):
        create_page_store("mooncake", directory=None, size_gb=1.0, namespace=NS, extra_config=extra)
