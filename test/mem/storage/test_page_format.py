import pytest

from pdserve.mem.storage import page_format
from pdserve.mem.storage.keys import chunk_keys, namespace
from pdserve.mem.storage.page_format import HEADER_BYTES, PageFormatError, crc32c, pack, unpack

NS = namespace({"model": "a"})
KEY, KEY2 = chunk_keys(NS, list(range(8)), 4)


def test_crc32c_is_castagnoli():
    assert crc32c(b"123456789") == 0xE3069283  # the standard check value


def test_round_trip_and_every_mismatch_is_a_typed_error():
    payload = bytes(range(256)) * 5
    blob = pack(NS, KEY, payload)
    assert len(blob) == HEADER_BYTES + len(payload)
    assert unpack(blob, NS, KEY) == payload
    assert unpack(pack(NS, KEY, b""), NS, KEY) == b""
    cases = {
        "wrong_namespace": (blob, namespace({"model": "b"}), KEY),
        "corrupt": (blob, NS, KEY2),
    }
    flipped_payload = bytearray(blob)
    flipped_payload[-1] ^= 1
    flipped_header = bytearray(blob)
    flipped_header[HEADER_BYTES - 12] ^= 1  # inside the length field: the header CRC catches it
    for name, bad in [("payload", flipped_payload), ("header", flipped_header)]:
        cases[f"corrupt-{name}"] = (bytes(bad), NS, KEY)
    cases["corrupt-truncated"] = (blob[:-1], NS, KEY)
    cases["corrupt-short"] = (blob[: HEADER_BYTES - 1], NS, KEY)
    cases["corrupt-magic"] = (b"XXXX" + blob[4:], NS, KEY)
    for name, (data, ns, key) in cases.items():
        with pytest.raises(PageFormatError) as err:
            unpack(data, ns, key)
        assert err.value.reason == name.split("-")[0], name
    assert page_format.header_view(blob) == (NS, KEY, len(payload))
