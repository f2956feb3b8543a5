"""File tier (NVMe): one file per page object under ``--hicache-storage-dir``, bounded, LRU, restart-safe.

Layout: ``<dir>/<first two hex digits of the key>/<64 hex digits of the key>``; in-flight writes
go to ``.<key hex>.<pid>.<n>.tmp`` in the same folder, are fsynced, renamed over the final name
(atomic on POSIX) and the folder fsynced, so a crash leaves either the whole object or a
temporary file, never a half-written page under a real name.

The index (key -> size, in LRU order) lives in memory and is rebuilt at start-up from the
folder: temporary files are deleted (a crashed writer's), files whose name is not a key, whose
header is malformed or whose size disagrees with the header are deleted, the rest are indexed
oldest-modified first. Payload CRCs are checked on load, not at start-up (that would read the
whole tier). A restarted server therefore reuses every page its predecessor completed.

One process owns a directory at a time (an ``flock`` on ``<dir>/.lock``): two servers sharing a
folder would evict each other's files behind their indexes' backs.

Pages are prompts' KV, so the tier is private to the server's user whatever its umask: folders
are 0700 and files 0600 from the moment they are created (``os.mkdir``/``os.open`` with the
mode; umask can only remove bits, and a folder made narrower by it is widened back to 0700).
A directory that already exists must belong to this user and be writable by nobody else
(anyone who could write it could plant or swap pages): otherwise start-up refuses, naming the
flag. Group/world-readable folders and files an older pdserve left are made private at start-up.
Under a token pages are signed (``page_format``), so even a page planted by someone who can write
the folder is a ``bad_mac`` miss.

``bypass_page_cache`` (extra config, for benchmarks): ``posix_fadvise(DONTNEED)`` after every
write (once fsynced, so the pages are clean and really dropped) and after every read, so loads
measure the disk instead of the OS page cache. It needs ``fsync`` (dirty pages are not dropped).
"""

from __future__ import annotations

import fcntl
import itertools
import os
import stat
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pdserve.mem.storage import page_format
from pdserve.mem.storage.base import Counters, check_key

GB = 10**9  # --hicache-storage-size-gb counts decimal gigabytes, like SGLang's --hicache-size
_TMP_SUFFIX = ".tmp"
_HEX = frozenset("0123456789abcdef")
DIR_MODE = 0o700  # folders and files of the tier: this user's only
FILE_MODE = 0o600


@dataclass(frozen=True)
class FileStoreConfig:
    directory: str
    capacity_bytes: int
    fsync: bool = True
    bypass_page_cache: bool = False

    def __post_init__(self) -> None:
        if not self.directory:
            raise ValueError("hicache_storage_dir: the file backend needs a directory")
        if self.capacity_bytes <= page_format.HEADER_BYTES:
            raise ValueError(f"hicache_storage_size_gb: {self.capacity_bytes} bytes cannot hold one page")
        if self.bypass_page_cache and not self.fsync:
            raise ValueError("hicache_storage_backend_extra_config.bypass_page_cache: needs fsync=true")


class FileStore:
    """The file tier behind the ``PageStore`` contract (``base.py``)."""

    name = "file"

    def __init__(self, config: FileStoreConfig, namespace: bytes, mac_key: bytes | None = None) -> None:
        """``mac_key``: pages are signed with it and unsigned ones refused (``page_format``)."""
        self.config = config
        self.namespace = check_key(namespace, "namespace")
        self._mac_key = mac_key
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, int] = OrderedDict()  # oldest use first
        self._writing: dict[bytes, int] = {}  # reserved by puts in flight
        self._used = 0  # bytes in the index plus reservations
        self._tmp_seq = itertools.count()
        self._closed = False
        self._counters = Counters()
        private_directory(config.directory, parents=True)
        self._lock_fd = _lock_directory(config.directory)
        for sub in range(256):
            private_directory(os.path.join(config.directory, f"{sub:02x}"))
        self._rebuild_index()

    # -- the contract ---------------------------------------------------------------------------

    def exists(self, keys: Sequence[bytes]) -> int:
        with self._lock:
            if self._closed:
                return 0
            for n, key in enumerate(keys):
                if key not in self._index:
                    return n
                # a page about to be loaded is the last one to evict
                self._index.move_to_end(key)
            return len(keys)

    def get(self, key: bytes) -> bytes | None:
        check_key(key)
        with self._lock:
            if self._closed:
                self._counters.miss("closed")
                return None
            if key not in self._index:
                self._counters.miss("miss_absent")
                return None
        read = self._read(key)
        if read is None:
            return None
        blob, inode = read
        try:
            payload = page_format.unpack(blob, self.namespace, key, self._mac_key)
        except page_format.PageFormatError as err:
            self._counters.miss(err.reason)
            self._discard(key, inode)
            return None
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
        self._counters.hit(len(payload))
        return payload

    def put(self, key: bytes, payload: bytes) -> bool:
        check_key(key)
        size = page_format.HEADER_BYTES + len(payload)
        with self._lock:
            if self._closed:
                self._counters.add("put_failures")
                return False
            if key in self._index or key in self._writing:
                self._counters.add("put_duplicates")  # content-addressed: the same key holds the same bytes
                return True
            if not self._reserve(key, size):
                self._counters.add("put_failures")
                return False
        ok = self._write(key, payload)
        with self._lock:
            self._writing.pop(key)
            if ok:
                self._index[key] = size
            else:
                self._used -= size
        self._counters.add("puts" if ok else "put_failures")
        if ok:
            self._counters.add("bytes_written", size)
        return ok

    def stats(self) -> dict[str, int]:
        out = self._counters.snapshot()
        with self._lock:
            out["objects"] = len(self._index)
            out["bytes_used"] = self._used
        out["capacity_bytes"] = self.config.capacity_bytes
        return out

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        os.close(self._lock_fd)  # releases the flock

    # -- index ----------------------------------------------------------------------------------

    def _reserve(self, key: bytes, size: int) -> bool:
        """Under the lock: evict LRU files until ``size`` fits, then reserve it for ``key``."""
        if size > self.config.capacity_bytes:
            return False
        self._evict_until_free(size)
        if self._used + size > self.config.capacity_bytes:  # the rest is reserved by puts in flight
            return False
        self._writing[key] = size
        self._used += size
        return True

    def _evict_until_free(self, size: int) -> None:
        """Under the lock: unlink least recently used files until ``size`` more bytes fit (or none is left)."""
        while self._used + size > self.config.capacity_bytes and self._index:
            victim, victim_size = self._index.popitem(last=False)
            self._used -= victim_size
            _unlink(self._path(victim))  # under the lock, so a concurrent re-put of it is not unlinked
            self._counters.add("evictions")

    def _discard(self, key: bytes, inode: int | None) -> None:
        """Forget ``key`` after its file failed to read or verify, so the next put rewrites it.

        ``inode``: the file that failed (None: it was missing). A file renamed over it meanwhile
        is a good one and stays.
        """
        with self._lock:
            path = self._path(key)
            try:
                current: int | None = os.stat(path).st_ino
            except OSError:
                current = None
            if current != inode:  # replaced (or, for a missing file, recreated) by a put meanwhile
                return
            size = self._index.pop(key, None)
            if size is not None:
                self._used -= size
            _unlink(path)

    def _rebuild_index(self) -> None:
        found: list[tuple[float, bytes, int]] = []
        kept = discarded = 0
        for sub in sorted(os.listdir(self.config.directory)):
            folder = os.path.join(self.config.directory, sub)
            if len(sub) != 2 or not set(sub) <= _HEX or not os.path.isdir(folder):
                continue
            for entry in os.scandir(folder):
                item = self._scan_entry(entry)
                if item is None:
                    _unlink(entry.path)
                    discarded += 1
                else:
                    found.append(item)
                    kept += 1
        for _mtime, key, size in sorted(found):
            self._index[key] = size
            self._used += size
        self._counters.add("startup_indexed", kept)
        self._counters.add("startup_discarded", discarded)
        with self._lock:
            self._evict_until_free(0)  # a smaller bound than last run's: the oldest go

    def _scan_entry(self, entry: os.DirEntry[str]) -> tuple[float, bytes, int] | None:
        """(mtime, key, size) of a complete object file; None for anything to delete."""
        name = entry.name
        if len(name) != 64 or not set(name) <= _HEX or not entry.is_file(follow_symlinks=False):
            return None  # temporary files, strays
        try:
            st = entry.stat(follow_symlinks=False)
            if st.st_mode & 0o077:  # an older pdserve's 0644
                os.chmod(entry.path, FILE_MODE)
            with open(entry.path, "rb", buffering=0) as f:
                head = f.read(page_format.HEADER_BYTES)
            _ns, key, length = page_format.header_view(head)
        except (OSError, page_format.PageFormatError):
            return None
        if key.hex() != name or st.st_size != page_format.HEADER_BYTES + length:
            return None
        return st.st_mtime, key, st.st_size

    # -- I/O ------------------------------------------------------------------------------------

    def _path(self, key: bytes) -> str:
        hexkey = key.hex()
        return os.path.join(self.config.directory, hexkey[:2], hexkey)

    def _read(self, key: bytes) -> tuple[bytes, int] | None:
        """(the file's bytes, its inode), or None after counting the miss."""
        try:
            fd = os.open(self._path(key), os.O_RDONLY)
        except FileNotFoundError:
            self._counters.miss("miss_absent")
            self._discard(key, None)
            return None
        except OSError:
            self._counters.miss("read_errors")
            return None
        try:
            return _read_all(fd, self.config.bypass_page_cache), os.fstat(fd).st_ino
        except OSError:
            self._counters.miss("read_errors")
            return None
        finally:
            os.close(fd)

    def _write(self, key: bytes, payload: bytes) -> bool:
        final = self._path(key)
        folder = os.path.dirname(final)
        tmp = os.path.join(folder, f".{key.hex()}.{os.getpid()}.{next(self._tmp_seq)}{_TMP_SUFFIX}")
        head = page_format.header(self.namespace, key, payload, self._mac_key)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
            try:
                _write_all(fd, [head, memoryview(payload)])
                if self.config.fsync:
                    os.fsync(fd)
                if self.config.bypass_page_cache:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            os.replace(tmp, final)
            if self.config.fsync:
                _fsync_dir(folder)
            return True
        except OSError:  # disk full, read-only, removed folder: the tier above still has the page
            _unlink(tmp)
            return False


def _read_all(fd: int, drop_cache: bool) -> bytes:
    size = os.fstat(fd).st_size
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    while got < size:
        n = os.readv(fd, [view[got:]])
        if n == 0:
            break  # truncated under us: unpack reports the short length
        got += n
    if drop_cache:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    return bytes(view[:got])


def _write_all(fd: int, parts: list[bytes | memoryview]) -> None:
    views = [memoryview(p).cast("B") for p in parts]
    while views:
        n = os.writev(fd, views)
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views:
            views[0] = views[0][n:]


def _fsync_dir(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink(path: str) -> None:
    """Best effort: a file that cannot be removed is already out of the index, so it only wastes space."""
    try:
        os.unlink(path)
    except OSError:
        pass


def private_directory(directory: str, parents: bool = False) -> None:
    """Make ``directory`` (mode 0700), or check that the one there is this user's and nobody
    else's to write, and make it 0700. ValueError naming the flag when it cannot be trusted."""
    if parents:
        os.makedirs(os.path.dirname(os.path.abspath(directory)), exist_ok=True)
    try:
        os.mkdir(directory, DIR_MODE)
    except FileExistsError:
        pass
    st = os.stat(directory)
    link = os.lstat(directory)
    me = os.geteuid()
    if stat.S_ISLNK(link.st_mode) and link.st_uid not in (me, 0):
        raise ValueError(f"hicache_storage_dir: {directory} is a symlink owned by uid {link.st_uid}, not this user")
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"hicache_storage_dir: {directory} is not a directory")
    if st.st_uid != me:
        raise ValueError(f"hicache_storage_dir: {directory} is owned by uid {st.st_uid}, not this user (uid {me});"
                         " the storage tier must be private to the server's user")
    if st.st_mode & 0o022:
        raise ValueError(f"hicache_storage_dir: {directory} is writable by other users (mode "
                         f"{stat.S_IMODE(st.st_mode):o}), who could plant pages; give a private folder, or check "
                         "its contents and chmod 700 it")
    if stat.S_IMODE(st.st_mode) != DIR_MODE:  # readable by others (an older pdserve), or narrowed by the umask
        os.chmod(directory, DIR_MODE)


def _lock_directory(directory: str) -> int:
    fd = os.open(os.path.join(directory, ".lock"), os.O_RDWR | os.O_CREAT, FILE_MODE)
    os.fchmod(fd, FILE_MODE)  # an older pdserve's lock file was 0644
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ValueError(f"hicache_storage_dir: {directory} is in use by another pdserve process") from None
    return fd


_EXTRA_KEYS = {"fsync": bool, "bypass_page_cache": bool}


def create_file_store(
    *,
    directory: str | None,
    size_gb: float,
    namespace: bytes,
    extra_config: Mapping[str, object],
    mac_key: bytes | None = None,
    host: str = "127.0.0.1",
) -> FileStore:
    """``create_page_store("file", ...)``: extra config keys ``fsync`` and ``bypass_page_cache`` (booleans);
    ``host`` is unused (one owner per folder, no peers)."""
    del host
    options: dict[str, bool] = {}
    for field, value in extra_config.items():
        if field not in _EXTRA_KEYS:
            raise ValueError(
                f"hicache_storage_backend_extra_config.{field}: not a file-backend option ({sorted(_EXTRA_KEYS)})"
            )
        if not isinstance(value, bool):
            raise ValueError(f"hicache_storage_backend_extra_config.{field}: must be a boolean, got {value!r}")
        options[field] = value
    config = FileStoreConfig(directory=directory or "", capacity_bytes=int(size_gb * GB), **options)
    return FileStore(config, namespace, mac_key)
