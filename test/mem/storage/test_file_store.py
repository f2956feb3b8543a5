import os
import threading

import pytest

from pdserve.mem.storage import create_page_store, page_format
from pdserve.mem.storage.base import PageStore
from pdserve.mem.storage.file import FileStore
from pdserve.mem.storage.keys import chunk_keys, namespace
from pdserve.mem.storage.page_format import HEADER_BYTES, pack

NS = namespace({"model": "a", "dtype": "bfloat16", "page_size": 4})
OTHER_NS = namespace({"model": "b", "dtype": "bfloat16", "page_size": 4})  # same KV shape, other weights
KEYS = chunk_keys(NS, list(range(120)), 4)
PAGE = 1000


def page(i: int) -> bytes:
    return bytes([i % 251]) * PAGE


def open_store(directory, size_gb: float = 1.0, **extra) -> FileStore:
    store = create_page_store("file", directory=str(directory), size_gb=size_gb, namespace=NS, extra_config=extra)
    assert isinstance(store, FileStore) and isinstance(store, PageStore)
    return store


def file_of(directory, key: bytes) -> str:
    return os.path.join(str(directory), key.hex()[:2], key.hex())


def test_round_trip_exists_and_counters(tmp_path):
    store = open_store(tmp_path, bypass_page_cache=True)
    assert store.exists(KEYS) == 0
    for i, key in enumerate(KEYS[:3]):
        assert store.put(key, page(i))
    assert store.put(KEYS[0], page(0))  # idempotent
    assert store.exists(KEYS) == 3
    assert store.exists(KEYS[1:]) == 2
    assert [store.get(k) for k in KEYS[:3]] == [page(0), page(1), page(2)]
    assert store.get(KEYS[5]) is None
    stats = store.stats()
    assert (stats["hits"], stats["misses"], stats["miss_absent"], stats["puts"]) == (3, 1, 1, 3)
    assert stats["bytes_read"] == 3 * PAGE and stats["bytes_written"] == 3 * (PAGE + HEADER_BYTES)
    store.close()
    store.close()
    assert store.get(KEYS[0]) is None and not store.put(KEYS[4], page(4))
    assert store.stats()["closed"] == 1


def test_damaged_files_are_counted_misses_never_wrong_bytes(tmp_path):
    store = open_store(tmp_path)
    for i, key in enumerate(KEYS[:4]):
        assert store.put(key, page(i))
    with open(file_of(tmp_path, KEYS[0]), "r+b") as f:  # one flipped payload byte
        f.seek(HEADER_BYTES + 10)
        f.write(bytes([page(0)[10] ^ 0xFF]))
    with open(file_of(tmp_path, KEYS[1]), "r+b") as f:  # truncated
        f.truncate(HEADER_BYTES + PAGE // 2)
    with open(file_of(tmp_path, KEYS[2]), "wb") as f:  # another model's page under this key's name
        f.write(pack(OTHER_NS, KEYS[2], page(2)))
    os.unlink(file_of(tmp_path, KEYS[3]))  # gone behind the index's back
    assert store.exists(KEYS) == 4  # the index still lists them: a hint
    assert [store.get(k) for k in KEYS[:4]] == [None] * 4
    stats = store.stats()
    assert (stats["corrupt"], stats["wrong_namespace"], stats["miss_absent"], stats["misses"]) == (2, 1, 1, 4)
    assert store.exists(KEYS) == 0 and stats["objects"] == 0 and stats["bytes_used"] == 0
    assert store.put(KEYS[0], page(0)) and store.get(KEYS[0]) == page(0)  # a rewrite heals it
    store.close()


def test_key_evicted_between_exists_and_get_is_a_miss(tmp_path):
    store = open_store(tmp_path, size_gb=3 * (PAGE + HEADER_BYTES) / 1e9)
    for i, key in enumerate(KEYS[:3]):
        assert store.put(key, page(i))
    assert store.exists(KEYS[:1]) == 1
    assert store.put(KEYS[3], page(3))  # the bound evicts the least recently used: KEYS[1]
    assert store.get(KEYS[1]) is None
    assert store.get(KEYS[0]) == page(0)  # exists() made it recent
    stats = store.stats()
    assert stats["evictions"] == 1 and stats["miss_absent"] == 1 and stats["objects"] == 3
    assert not os.path.exists(file_of(tmp_path, KEYS[1]))
    store.close()


def _run_all(threads: list[threading.Thread]) -> None:
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _bytes_on_disk(folder) -> int:
    """Bytes of every object file under ``folder`` (the lock file is not an object)."""
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(folder) for f in fs if f != ".lock")


def test_size_bound_holds_under_concurrent_puts_and_refuses_oversize(tmp_path):
    cap = 5 * (PAGE + HEADER_BYTES)
    store = open_store(tmp_path, size_gb=cap / 1e9, fsync=False)
    assert not store.put(KEYS[0], b"x" * cap)  # larger than the whole tier
    threads = [threading.Thread(target=lambda k=k, i=i: store.put(k, page(i))) for i, k in enumerate(KEYS)]
    _run_all(threads)
    stats = store.stats()
    on_disk = _bytes_on_disk(tmp_path)
    assert stats["bytes_used"] == on_disk <= cap and stats["objects"] == 5
    # Every put is counted once: stored, or refused because the bound was reserved by puts still
    # in flight (how many depends on the threads' interleaving), plus the oversize one.
    assert stats["puts"] + stats["put_failures"] == len(KEYS) + 1
    assert stats["puts"] >= 5 and stats["put_failures"] >= 1
    for i, key in enumerate(KEYS):
        assert store.get(key) in (None, page(i))
    store.close()


def test_restart_rebuilds_the_index_and_ignores_temp_and_broken_files(tmp_path):
    store = open_store(tmp_path)
    for i, key in enumerate(KEYS[:3]):
        assert store.put(key, page(i))
    with pytest.raises(ValueError, match="hicache_storage_dir"):
        open_store(tmp_path)  # one owner per directory
    store.close()
    folder = os.path.dirname(file_of(tmp_path, KEYS[3]))
    with open(os.path.join(folder, f".{KEYS[3].hex()}.1.0.tmp"), "wb") as f:  # a crashed writer's
        f.write(pack(NS, KEYS[3], page(3)))
    with open(file_of(tmp_path, KEYS[4]), "wb") as f:  # shorter than a header
        f.write(b"PDKV")
    with open(file_of(tmp_path, KEYS[5]), "wb") as f:  # header says more than the file holds
        f.write(pack(NS, KEYS[5], page(5))[:-1])
    store = open_store(tmp_path)
    stats = store.stats()
    assert (stats["startup_indexed"], stats["startup_discarded"]) == (3, 3)
    assert store.exists(KEYS) == 3
    assert [store.get(k) for k in KEYS[:3]] == [page(0), page(1), page(2)]
    assert sorted(os.listdir(folder)) == sorted(n for n in os.listdir(folder) if not n.endswith(".tmp"))
    store.close()
    smaller = open_store(tmp_path, size_gb=2 * (PAGE + HEADER_BYTES) / 1e9)  # a smaller bound on restart
    assert smaller.stats()["objects"] == 2 and smaller.stats()["evictions"] == 1
    smaller.close()


def test_failed_write_is_a_put_failure(tmp_path):
    store = open_store(tmp_path)
    folder = os.path.dirname(file_of(tmp_path, KEYS[0]))
    os.rmdir(folder)
    with open(folder, "wb"):  # a file where the folder was: every write there fails (even as root)
        pass
    assert not store.put(KEYS[0], page(0))
    assert store.stats()["put_failures"] == 1 and store.stats()["bytes_used"] == 0
    os.unlink(folder)
    os.mkdir(folder)
    assert store.put(KEYS[0], page(0)) and store.get(KEYS[0]) == page(0)
    store.close()


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"directory": None}, "hicache_storage_dir"),
        ({"size_gb": 0}, "hicache_storage_size_gb"),
        ({"extra_config": {"fsynk": True}}, "extra_config.fsynk"),
        ({"extra_config": {"fsync": "yes"}}, "extra_config.fsync"),
        ({"extra_config": {"fsync": False, "bypass_page_cache": True}}, "bypass_page_cache"),
        ({"backend": "nfs"}, "hicache_storage_backend"),
    ],
)
def test_bad_config_names_the_field(tmp_path, kwargs, field):
    args = {"backend": "file", "directory": str(tmp_path), "size_gb": 1.0, "namespace": NS, "extra_config": None}
    args.update(kwargs)
    backend = args.pop("backend")
    with pytest.raises(ValueError, match=field):
        create_page_store(backend, **args)


def test_concurrent_readers_writers_and_evictions_keep_the_accounting(tmp_path):
    # a bound of 6 pages under 4 threads putting and getting 24 keys: evictions race lookups and loads
    store = open_store(tmp_path, size_gb=6 * (PAGE + HEADER_BYTES) / 1e9, fsync=False)
    wrong: list[bytes] = []

    def worker(seed: int) -> None:
        for step in range(60):
            i = (seed * 7 + step * 5) % 24
            if step % 3 == 0:
                store.put(KEYS[i], page(i))
            else:
                n = store.exists(KEYS[i : i + 2])
                got = store.get(KEYS[i])
                if got is not None and got != page(i):
                    wrong.append(KEYS[i])
                assert 0 <= n <= 2

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    _run_all(threads)
    stats = store.stats()
    on_disk = _bytes_on_disk(tmp_path)
    assert not wrong
    assert stats["bytes_used"] == on_disk <= 6 * (PAGE + HEADER_BYTES)
    assert stats["objects"] == len([f for _, _, fs in os.walk(tmp_path) for f in fs if f != ".lock"])
    assert stats["hits"] + stats["misses"] == 4 * 40 and stats["corrupt"] == 0
    store.close()


def _modes(root) -> dict[str, int]:
    """Permission bits of ``root`` and of every folder and file under it, by path relative to it."""
    out = {".": os.stat(root).st_mode & 0o777}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(folder, name)
            out[os.path.relpath(path, root)] = os.stat(path).st_mode & 0o777
    return out


def test_folders_and_files_are_private_whatever_the_umask(tmp_path):
    """Stored pages are other users' prompts: 0700 folders and 0600 files, even under umask 000."""
    root = tmp_path / "kv"
    old = os.umask(0)
    try:
        store = open_store(root)
        assert store.put(KEYS[0], page(0)) and store.put(KEYS[1], page(1))
        store.close()
    finally:
        os.umask(old)
    modes = _modes(root)
    assert len(modes) == 1 + 256 + 1 + 2  # the root, its 256 folders, the lock file, two pages
    folders = {p for p in modes if os.path.isdir(os.path.join(root, p))}
    assert {modes[p] for p in folders} == {0o700}
    assert {modes[p] for p in modes.keys() - folders} == {0o600}


def test_an_older_tiers_open_modes_are_made_private_and_its_pages_kept(tmp_path):
    store = open_store(tmp_path)
    assert store.put(KEYS[0], page(0))
    store.close()
    for path in [tmp_path, *tmp_path.rglob("*")]:  # as an older pdserve under umask 022 left them
        path.chmod(0o755 if path.is_dir() else 0o644)
    store = open_store(tmp_path)
    assert set(_modes(tmp_path).values()) <= {0o700, 0o600}
    assert store.get(KEYS[0]) == page(0)
    store.close()


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o1777])
def test_a_storage_dir_others_may_write_is_refused(tmp_path, mode):
    """Anyone who can write the folder can plant pages or swap files: refuse, naming the flag."""
    root = tmp_path / "shared"
    root.mkdir()
    root.chmod(mode)
    with pytest.raises(ValueError, match=r"hicache_storage_dir: .*shared is writable by other users"):
        open_store(root)


def test_a_storage_dir_owned_by_another_user_is_refused(tmp_path, monkeypatch):
    root = tmp_path / "theirs"
    root.mkdir(mode=0o700)
    monkeypatch.setattr(os, "geteuid", lambda: os.stat(root).st_uid + 1)
    with pytest.raises(ValueError, match=r"hicache_storage_dir: .*theirs is owned by uid \d+, not this user"):
        open_store(root)


def test_under_a_token_a_planted_page_is_a_counted_miss(tmp_path):
    """A page that is well-formed (right namespace, key, length and CRC) but was written without
    the token, or under another one, is a ``bad_mac`` miss and is deleted; signed pages hit."""
    store = create_page_store("file", directory=str(tmp_path), size_gb=1.0, namespace=NS, extra_config=None,
                              auth_token="secret")
    for i, key in enumerate(KEYS[:3]):
        assert store.put(key, page(i))
    with open(file_of(tmp_path, KEYS[0]), "wb") as f:
        f.write(pack(NS, KEYS[0], b"\xee" * PAGE))  # no MAC
    with open(file_of(tmp_path, KEYS[1]), "wb") as f:
        f.write(pack(NS, KEYS[1], b"\xee" * PAGE, page_format.mac_key("guessed")))
    assert [store.get(k) for k in KEYS[:3]] == [None, None, page(2)]
    stats = store.stats()
    assert (stats["bad_mac"], stats["misses"], stats["hits"], stats["corrupt"]) == (2, 2, 1, 0)
    assert not os.path.exists(file_of(tmp_path, KEYS[0])) and store.exists(KEYS) == 0
    store.close()
    untokened = open_store(tmp_path)  # without a token the MAC is not needed (CRC only, as before)
    assert untokened.get(KEYS[2]) == page(2)
    untokened.close()
