import threading

from pdserve.mem.storage import create_page_store
from pdserve.mem.storage.keys import chunk_keys, namespace
from pdserve.mem.storage.memory import Faults, FaultyStore, MemoryStore
from pdserve.mem.storage.page_format import HEADER_BYTES, pack

NS = namespace({"model": "a"})
KEYS = chunk_keys(NS, list(range(64)), 4)


def page(i: int) -> bytes:
    return bytes([i]) * 100


def test_memory_store_verifies_like_the_real_tiers():
    store = create_page_store(
        "memory", directory=None, size_gb=3 * (100 + HEADER_BYTES) / 1e9, namespace=NS, extra_config=None
    )
    assert isinstance(store, MemoryStore)
    for i in range(4):
        assert store.put(KEYS[i], page(i))
    assert store.exists(KEYS) == 0 and store.exists(KEYS[1:]) == 3  # KEYS[0] was evicted
    store.corrupt(KEYS[1])
    store.replace_raw(KEYS[2], pack(namespace({"model": "b"}), KEYS[2], page(2)))
    assert [store.get(k) for k in KEYS[1:4]] == [None, None, page(3)]
    stats = store.stats()
    assert (stats["corrupt"], stats["wrong_namespace"], stats["hits"], stats["evictions"]) == (1, 1, 1, 1)
    assert stats["objects"] == 1 and stats["bytes_used"] == 100 + HEADER_BYTES


def test_faulty_store_injects_eviction_after_lookup_delay_and_put_failure():
    faults = Faults(evict_after_exists=True)
    store = FaultyStore(MemoryStore(10**6, NS), faults)
    assert store.put(KEYS[0], page(0)) and store.put(KEYS[1], page(1))
    assert store.exists(KEYS[:2]) == 2
    assert store.get(KEYS[0]) is None and store.get(KEYS[1]) is None  # gone between exists and get
    faults.evict_after_exists, faults.fail_puts = False, True
    assert not store.put(KEYS[2], page(2))
    faults.fail_puts, faults.get_delay_s = False, 0.05
    assert store.put(KEYS[3], page(3))
    got: list[bytes | None] = []
    loader = threading.Thread(target=lambda: got.append(store.get(KEYS[3])))
    loader.start()
    loader.join()
    assert got == [page(3)]
    stats = store.stats()
    assert stats["injected_evictions"] == 2 and stats["put_failures"] == 1 and stats["miss_absent"] == 2
    assert stats["injected_delays"] == 1 and stats["hits"] == 1
