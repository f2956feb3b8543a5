"""Mooncake Store tier: pages in ``mooncake.store`` segments, shared by every client of one ``mooncake_master``.

Who owns what:

* **The master** (``MooncakeMaster``) is a ``mooncake_master`` subprocess holding only metadata
  (which key lives in which segment). Whoever starts it stops it: a test fixture, ``pdserve up``,
  or a store created with ``start_master: true`` (then ``close`` stops it).
* **Segment memory** is lent by clients: ``global_segment_size`` bytes of *this* process's
  memory join the cluster-wide pool at ``setup`` and leave it at ``close`` (or when the process
  dies, after the master's ``client_ttl``); every page any client put there is then gone, and
  a ``get`` of it is a miss. ``global_segment_size: 0`` makes a pure client that stores into
  other processes' segments. ``local_buffer_size`` is this client's staging buffer for puts
  and gets (an object larger than it cannot be stored).

Failures are misses, not errors (``base.py``): a full pool is a put failure (``put_full``), a
dead master makes every call fail within Mooncake's own retry (about 4 s for a put) and then,
for ``master_retry_s``, fail at once without calling it (``master_down``), so a storage thread
never stalls behind a dead master longer than one attempt. Only ``setup`` raises: a server that
cannot join its configured store at start-up should say so.

Objects are ``page_format`` blobs under ``pdkv/<key hex>``; Mooncake may return an older
complete version of a key or none at all, and the header check turns anything but the page asked
for into a counted miss. Any client of the master may put any key, so under a token pages are
signed and one without a valid MAC is a ``bad_mac`` miss, removed like any bad object.

SSD offload: the wheel's ``setup`` takes ``enable_ssd_offload`` and ``ssd_offload_path`` and
the master ``-enable_offload``; both are passed through (extra config keys of the same names,
``MooncakeMaster(enable_offload=True)``). Checked with mooncake-transfer-engine-non-cuda 0.3.13
on a CPU host, over TCP: in-process (``setup(enable_ssd_offload=True)``) and as Mooncake's
documented "real client" (the wheel's ``mooncake_client -enable_offload=true`` with
``MOONCAKE_OFFLOAD_FILE_STORAGE_PATH`` and the bucket backend) the segment owner mounts a
"local disk segment", yet 15 s after the pool filled (1 MiB objects, 100 ms leases) no file had
been written, puts into the full pool still failed and evicted keys were not served from disk.
So pdserve's NVMe leg is the file tier, and Mooncake's offload is exposed but not relied on.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.mem.storage import page_format
from pdserve.mem.storage.base import Counters, check_key

GB = 10**9
KEY_PREFIX = "pdkv/"
_RPC_FAIL = -900  # Mooncake's ErrorCode::RPC_FAIL: the master did not answer
_NO_SPACE = (-200, -600)  # no segment space / no local buffer space for this object
_SIZE_SUFFIXES = (("kb", 1 << 10), ("mb", 1 << 20), ("gb", 1 << 30), ("k", 1 << 10), ("m", 1 << 20), ("g", 1 << 30))


class MooncakeStoreError(RuntimeError):
    """The store could not be set up (or the master started); the message names the setting."""


def _import_store() -> Any:
    from pdserve.transfer import mooncake_log
    from pdserve.transfer.mooncake import MOONCAKE_INSTALL_HINT

    mooncake_log.set_level()  # read once, when the library loads
    try:
        return importlib.import_module("mooncake.store")  # untyped C extension: used through Any
    except ImportError as e:
        raise MooncakeStoreError(f"the Mooncake Store backend is unavailable ({e}): {MOONCAKE_INSTALL_HINT}") from e


def master_binary() -> str:
    """The ``mooncake_master`` shipped inside the installed ``mooncake`` package (else the one on PATH)."""
    spec = importlib.util.find_spec("mooncake")  # its location only: loading it is not needed to run a binary
    if spec is not None and spec.origin is not None:
        path = os.path.join(os.path.dirname(spec.origin), "mooncake_master")
        if os.access(path, os.X_OK):
            return path
    found = shutil.which("mooncake_master")
    if found is None:
        raise MooncakeStoreError("mooncake_master: not found in the mooncake package or on PATH")
    return found


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class MooncakeMaster:
    """A ``mooncake_master`` whose every listener (RPC, metrics) is on ``host``.

    Its HTTP metadata server is off: the 0.3.13 binary binds it to 0.0.0.0 whatever
    ``-http_metadata_server_host`` says, and it takes a ``PUT`` from anyone. Clients find each
    other's segments by P2P handshake instead (``metadata_server``), as the transfer engines do.

    ``start`` returns once the RPC port accepts connections; ``stop`` terminates it (SIGKILL after
    ``stop_timeout_s``). Its log goes to ``log_path``: by default a file in a fresh 0700 folder, as
    a predictable name in /tmp could be a link another local user planted; ``stop`` removes that
    folder, unless the master died on its own (its log says why).
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        *,
        enable_offload: bool = False,
        extra_args: Sequence[str] = (),
        log_path: str | None = None,
        start_timeout_s: float = 30.0,
    ) -> None:
        self.host = host
        self.enable_offload = enable_offload
        self.extra_args = tuple(extra_args)
        self._log_dir: str | None = None  # the private folder start makes when no log_path is given
        self.log_path = log_path or ""
        self.start_timeout_s = start_timeout_s
        self.rpc_port = 0
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        """``master_server_address`` for clients."""
        return f"{self.host}:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        """``metadata_server`` for clients: none on the master (see the class), segments by P2P handshake."""
        return "P2PHANDSHAKE"

    def start(self) -> MooncakeMaster:
        if self._proc is not None:
            raise MooncakeStoreError("mooncake_master: already started")
        self.rpc_port, metrics_port = (_free_port(self.host) for _ in range(2))
        args = [
            master_binary(),
            f"-rpc_address={self.host}",
            f"-rpc_port={self.rpc_port}",
            "-enable_http_metadata_server=false",
            f"-metrics_host={self.host}",
            f"-metrics_port={metrics_port}",
            f"-enable_offload={'true' if self.enable_offload else 'false'}",
            *self.extra_args,
        ]
        if not self.log_path or self._log_dir is not None:
            self._log_dir = tempfile.mkdtemp(prefix="pdserve-mooncake-master-")  # mode 0700: ours alone
            self.log_path = os.path.join(self._log_dir, "master.log")
        # O_NOFOLLOW as well, for a log_path the caller named.
        fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with open(fd, "wb") as log:
            self._proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        pending = [self.rpc_port]
        while pending:
            if self._proc is None or self._proc.poll() is not None:
                raise MooncakeStoreError(f"mooncake_master exited at start-up; see {self.log_path}")
            if time.monotonic() > deadline:
                raise MooncakeStoreError(f"mooncake_master: ports not open after {self.start_timeout_s} s")
            try:
                socket.create_connection((self.host, pending[0]), timeout=0.2).close()
                pending.pop(0)
            except OSError:
                time.sleep(0.05)

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def stop(self, stop_timeout_s: float = 5.0) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        died = proc.poll() is not None
        proc.terminate()
        try:
            proc.wait(stop_timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if not died and self._log_dir is not None:
            shutil.rmtree(self._log_dir, ignore_errors=True)

    def kill(self) -> None:
        """SIGKILL, as a crash would (tests of a dead master)."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None
            if self._log_dir is not None:  # its owner killed it: nothing to diagnose
                shutil.rmtree(self._log_dir, ignore_errors=True)

    def __enter__(self) -> MooncakeMaster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass(frozen=True)
class MooncakeStoreConfig:
    """Mooncake's own key names (``--hicache-storage-backend-extra-config``); sizes in bytes."""

    master_server_address: str = ""
    metadata_server: str = "P2PHANDSHAKE"
    local_hostname: str = "127.0.0.1"
    global_segment_size: int = 0
    local_buffer_size: int = 64 << 20
    protocol: str = "tcp"
    device_name: str = ""
    enable_ssd_offload: bool = False
    ssd_offload_path: str = ""
    tenant_id: str = "default"
    master_retry_s: float = 1.0

    def __post_init__(self) -> None:
        if not self.master_server_address:
            raise ValueError(
                "hicache_storage_backend_extra_config.master_server_address: needed (host:port of mooncake_master),"
                " or start_master: true to start one locally"
            )
        if self.global_segment_size < 0 or self.local_buffer_size <= 0:
            raise ValueError(
                "hicache_storage_backend_extra_config: global_segment_size must be >= 0 and local_buffer_size > 0"
            )
        if self.enable_ssd_offload and not self.ssd_offload_path:
            raise ValueError("hicache_storage_backend_extra_config.ssd_offload_path: needed with enable_ssd_offload")
        if self.master_retry_s < 0:
            raise ValueError("hicache_storage_backend_extra_config.master_retry_s: must be >= 0")

    def setup_dict(self) -> dict[str, object]:
        return {
            "local_hostname": self.local_hostname,
            "metadata_server": self.metadata_server,
            "global_segment_size": self.global_segment_size,
            "local_buffer_size": self.local_buffer_size,
            "protocol": self.protocol,
            "rdma_devices": self.device_name,
            "master_server_addr": self.master_server_address,
            "enable_ssd_offload": self.enable_ssd_offload,
            "ssd_offload_path": self.ssd_offload_path,
            "tenant_id": self.tenant_id,
        }


class MooncakeStore:
    """The Mooncake Store tier behind the ``PageStore`` contract (``base.py``)."""

    name = "mooncake"

    def __init__(
        self,
        config: MooncakeStoreConfig,
        namespace: bytes,
        *,
        master: MooncakeMaster | None = None,
        mac_key: bytes | None = None,
    ) -> None:
        """``master``: a master this store owns and stops on ``close`` (None: someone else's);
        ``mac_key``: pages are signed with it and unsigned ones refused (``page_format``)."""
        self.config = config
        self.namespace = check_key(namespace, "namespace")
        self._mac_key = mac_key
        self._master = master
        self._counters = Counters()
        self._lock = threading.Lock()
        self._closed = False
        self._down_until = 0.0
        self._store = _import_store().MooncakeDistributedStore()
        rc = self._store.setup(config.setup_dict())
        if rc != 0:
            self._stop_master()
            raise MooncakeStoreError(
                f"Mooncake Store setup returned {rc} (master_server_address={config.master_server_address}, "
                f"metadata_server={config.metadata_server}, global_segment_size={config.global_segment_size}, "
                f"local_buffer_size={config.local_buffer_size}); is the master running and are the sizes possible?"
            )

    # -- the contract ---------------------------------------------------------------------------

    def exists(self, keys: Sequence[bytes]) -> int:
        if not keys or not self._usable():
            return 0
        try:
            found = self._store.batch_is_exist([_store_key(k) for k in keys])
        except Exception:  # the binding's errors are misses here, never the caller's problem
            self._master_failed()
            return 0
        for n, flag in enumerate(found):
            if flag != 1:
                if flag < 0:
                    self._master_failed()
                return n
        return len(keys)

    def get(self, key: bytes) -> bytes | None:
        store_key = _store_key(key)
        if not self._usable():
            self._counters.miss("closed" if self._closed else "master_down")
            return None
        try:
            blob = self._store.get(store_key)
        except Exception:  # the binding raises its own types: a failed call, not a caller bug
            self._master_failed()
            self._counters.miss("read_errors")
            return None
        if not blob:  # absent, evicted, its segment gone, or the master unreachable: Mooncake says b""
            self._counters.miss("miss_absent")
            return None
        try:
            payload = page_format.unpack(blob, self.namespace, key, self._mac_key)
        except page_format.PageFormatError as err:
            self._counters.miss(err.reason)
            # Mooncake keeps the first value of a key (a later put returns 0 and changes nothing),
            # so a bad object would shadow the key for good unless it is removed.
            with contextlib.suppress(Exception):
                self._store.remove(store_key, True)  # force: past the read lease (readers verify anyway)
            return None
        self._counters.hit(len(payload))
        return payload

    def put(self, key: bytes, payload: bytes) -> bool:
        store_key = _store_key(key)
        if not self._usable():
            self._counters.add("put_failures")
            self._counters.add("closed" if self._closed else "master_down")
            return False
        head = page_format.header(self.namespace, key, payload, self._mac_key)
        try:
            rc = self._store.put_parts(store_key, head, payload)
        except Exception:  # the binding raises its own types: a failed call, not a caller bug
            rc = _RPC_FAIL
        return self._put_result(rc, len(head) + len(payload))

    def stats(self) -> dict[str, int]:
        return self._counters.snapshot()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        with contextlib.suppress(Exception):
            self._store.close()  # returns this process's segment to nobody: its pages are gone
        self._stop_master()

    # -- helpers --------------------------------------------------------------------------------

    def _put_result(self, rc: int, nbytes: int) -> bool:
        if rc == 0:
            self._counters.add("puts")
            self._counters.add("bytes_written", nbytes)
            return True
        self._counters.add("put_failures")
        if rc in _NO_SPACE:
            self._counters.add("put_full")
        elif rc == _RPC_FAIL:
            self._master_failed()
        return False

    def _usable(self) -> bool:
        return not self._closed and time.monotonic() >= self._down_until

    def _master_failed(self) -> None:
        """Skip the master for ``master_retry_s``: each call to a dead one costs Mooncake's retries."""
        self._counters.add("master_errors")
        self._down_until = time.monotonic() + self.config.master_retry_s

    def _stop_master(self) -> None:
        if self._master is not None:
            self._master.stop()
            self._master = None


def reachable_host(host: str) -> str:
    """``host`` as other machines reach it: a wildcard bind (``0.0.0.0``, ``::``) is no address
    to advertise, so the one this machine's name resolves to instead."""
    if host in ("0.0.0.0", "::", ""):
        return socket.gethostbyname(socket.gethostname())
    return host


def _store_key(key: bytes) -> str:
    return KEY_PREFIX + check_key(key).hex()


def parse_size(field: str, value: object) -> int:
    """Bytes from an int or a string with Mooncake's suffixes (``"64mb"``, ``"1gb"``, binary units)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        text = value.strip().lower()
        for suffix, unit in _SIZE_SUFFIXES:
            if text.endswith(suffix) and text[: -len(suffix)].strip().replace(".", "", 1).isdigit():
                return int(float(text[: -len(suffix)]) * unit)
        if text.isdigit():
            return int(text)
    raise ValueError(f"hicache_storage_backend_extra_config.{field}: {value!r} is not a size (bytes, or '64mb')")


_STR_KEYS = ("master_server_address", "metadata_server", "local_hostname", "protocol", "device_name")
_STR_KEYS_MORE = ("ssd_offload_path", "tenant_id")
_BOOL_KEYS = ("enable_ssd_offload", "start_master")
_SIZE_KEYS = ("global_segment_size", "local_buffer_size")
_ALIASES = {"master_server_addr": "master_server_address", "rdma_devices": "device_name"}


def _parse_extra(extra: Mapping[str, object]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for raw_field, value in extra.items():
        field = _ALIASES.get(raw_field, raw_field)
        if field in _STR_KEYS or field in _STR_KEYS_MORE:
            if not isinstance(value, str):
                raise ValueError(f"hicache_storage_backend_extra_config.{raw_field}: must be a string")
            out[field] = value
        elif field in _BOOL_KEYS:
            if not isinstance(value, bool):
                raise ValueError(f"hicache_storage_backend_extra_config.{raw_field}: must be a boolean")
            out[field] = value
        elif field in _SIZE_KEYS:
            out[field] = parse_size(raw_field, value)
        elif field == "master_retry_s":
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"hicache_storage_backend_extra_config.{raw_field}: must be a number")
            out[field] = float(value)
        else:
            known = sorted((*_STR_KEYS, *_STR_KEYS_MORE, *_BOOL_KEYS, *_SIZE_KEYS, "master_retry_s"))
            raise ValueError(f"hicache_storage_backend_extra_config.{raw_field}: not a Mooncake Store option {known}")
    return out


def create_mooncake_store(
    *,
    directory: str | None,
    size_gb: float,
    namespace: bytes,
    extra_config: Mapping[str, object],
    mac_key: bytes | None = None,
    host: str = "127.0.0.1",
) -> MooncakeStore:
    """``create_page_store("mooncake", ...)``.

    ``global_segment_size`` defaults to ``size_gb`` (this process lends that much memory), and
    ``local_hostname`` (where the other clients reach the segment it lends) to ``host``, the
    server's ``--host`` (a wildcard: the address the host name resolves to); with
    ``start_master: true`` and no ``master_server_address`` a local master is started and owned
    by the store. ``directory`` is unused (the SSD leg is ``ssd_offload_path``).
    """
    del directory
    options = _parse_extra(extra_config)
    start_master = options.pop("start_master", False)
    options.setdefault("global_segment_size", int(size_gb * GB))
    options.setdefault("local_hostname", reachable_host(host))
    master: MooncakeMaster | None = None
    if start_master:
        if "master_server_address" in options:
            raise ValueError(
                "hicache_storage_backend_extra_config: give master_server_address or start_master, not both"
            )
        master = MooncakeMaster(
            options["local_hostname"], enable_offload=options.get("enable_ssd_offload", False)
        ).start()
        options["master_server_address"] = master.address
        options.setdefault("metadata_server", master.metadata_server)
    try:
        config = MooncakeStoreConfig(**options)
        return MooncakeStore(config, namespace, master=master, mac_key=mac_key)
    except BaseException:
        if master is not None:
            master.stop()
        raise
