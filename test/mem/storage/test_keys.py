import hashlib
import struct
import subprocess
import sys

import pytest

from pdserve.mem.storage.keys import chunk_keys, namespace

COMPAT = {"model": "fingerprint-a", "dtype": "bfloat16", "page_size": 16, "layout": "page_first", "tp_shard": "0/1"}


def test_chain_is_sha256_over_little_endian_uint32_from_the_namespace():
    ns = namespace(COMPAT)
    tokens = [1, 2**32 - 1, 7, 300, 5]
    keys = chunk_keys(ns, tokens, 2)
    first = hashlib.sha256(ns + struct.pack("<2I", 1, 2**32 - 1)).digest()
    second = hashlib.sha256(first + struct.pack("<2I", 7, 300)).digest()
    assert keys == [first, second]  # the trailing partial chunk [5] gets no key
    assert chunk_keys(ns, tokens[2:4], 2, parent=first) == [second]
    assert chunk_keys(ns, [1, 2, 3], 4) == []


def test_keys_are_equal_in_another_process():
    code = (
        "from pdserve.mem.storage.keys import chunk_keys, namespace;"
        f"print(','.join(k.hex() for k in chunk_keys(namespace({COMPAT!r}, 's'), list(range(100)), 16)))"
    )
    # a different hash seed: Python's hash() would change, these must not
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={"PYTHONHASHSEED": "123", **_env()},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert out.split(",") == [k.hex() for k in chunk_keys(namespace(COMPAT, "s"), list(range(100)), 16)]


def _env():
    import os

    return {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}


def test_namespace_salt_and_tokens_each_change_every_key():
    tokens = list(range(64))
    base = chunk_keys(namespace(COMPAT), tokens, 16)
    other_model = chunk_keys(namespace({**COMPAT, "model": "fingerprint-b"}), tokens, 16)
    other_shard = chunk_keys(namespace({**COMPAT, "tp_shard": "1/2"}), tokens, 16)
    salted = chunk_keys(namespace(COMPAT, salt="tenant-1"), tokens, 16)
    changed_first = chunk_keys(namespace(COMPAT), [9] + tokens[1:], 16)
    for keys in (other_model, other_shard, salted, changed_first):
        assert not set(keys) & set(base)  # chaining: a changed first chunk changes every later key
    changed_last = chunk_keys(namespace(COMPAT), tokens[:-1] + [0], 16)
    assert changed_last[:3] == base[:3] and changed_last[3] != base[3]
    assert namespace(dict(reversed(list(COMPAT.items())))) == namespace(COMPAT)  # field order is not identity


@pytest.mark.parametrize(
    "call, field",
    [
        (lambda ns: chunk_keys(ns, [1, -1], 2), "token_ids"),
        (lambda ns: chunk_keys(ns, [1, 2**32], 2), "token_ids"),
        (lambda ns: chunk_keys(ns, [1, 2], 0), "chunk_tokens"),
        (lambda ns: chunk_keys(b"short", [1, 2], 2), "namespace"),
        (lambda ns: chunk_keys(ns, [1, 2], 2, parent=b"x"), "parent"),
        (lambda ns: namespace({}), "compat"),
        (lambda ns: namespace({"model": object()}), "compat.model"),
        (lambda ns: namespace(COMPAT, salt=3), "salt"),  # type: ignore[arg-type]
    ],
)
def test_bad_input_names_the_field(call, field):
    with pytest.raises(ValueError, match=field):
        call(namespace(COMPAT))
