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
    flipped_header[76] ^= 1  # inside the length field (bytes 72..80): the header CRC catches it
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


MAC_KEY = page_format.mac_key("the deployment's token")


def test_a_page_under_a_token_needs_its_mac():
    """With a key every page must carry a valid HMAC over header and payload: a page written
    without the token (a correct CRC, no MAC) or under another token is refused as ``bad_mac``."""
    payload = bytes(range(200))
    signed = pack(NS, KEY, payload, MAC_KEY)
    assert len(signed) == HEADER_BYTES + len(payload)
    assert unpack(signed, NS, KEY, MAC_KEY) == payload
    assert unpack(signed, NS, KEY) == payload  # no token configured: CRC only, as before
    planted = {
        "unsigned": pack(NS, KEY, payload),
        "other token": pack(NS, KEY, payload, page_format.mac_key("another token")),
    }
    forged = bytearray(pack(NS, KEY, bytes(200), MAC_KEY))  # a signed page's MAC on other bytes
    forged[HEADER_BYTES - 36 : HEADER_BYTES - 4] = signed[HEADER_BYTES - 36 : HEADER_BYTES - 4]
    forged[HEADER_BYTES - 4 : HEADER_BYTES] = crc32c(bytes(forged[: HEADER_BYTES - 4])).to_bytes(4, "little")
    planted["mac moved onto other bytes"] = bytes(forged)
    for what, blob in planted.items():
        page_format.header_view(blob)  # well-formed: only the MAC tells it apart
        with pytest.raises(PageFormatError) as err:
            unpack(blob, NS, KEY, MAC_KEY)
        assert err.value.reason == "bad_mac", what
    assert page_format.mac_key("t") != page_format.mac_key("u") and len(MAC_KEY) == 32


# Header fields (page_format's layout): namespace at bytes 8..40, key at 40..72.
NS_FIELD, KEY_FIELD = slice(8, 40), slice(40, 72)


def rewritten(blob: bytes, field: slice, value: bytes) -> bytes:
    """``blob`` with one header field replaced and the header CRC fixed: what anyone who can write
    the store can do without the token."""
    out = bytearray(blob)
    out[field] = value
    out[HEADER_BYTES - 4 : HEADER_BYTES] = crc32c(bytes(out[: HEADER_BYTES - 4])).to_bytes(4, "little")
    return bytes(out)


def test_a_signed_page_copied_under_another_key_or_namespace_is_a_bad_mac():
    """The MAC binds a page to its key and namespace, not only to its payload: a page signed for one
    prefix, its key field (or namespace field) rewritten and the header CRC fixed, is well-formed and
    carries a genuine MAC of its bytes, and is still refused as ``bad_mac``."""
    payload = bytes(range(200))
    other_ns = namespace({"model": "b"})
    moved = {
        "key": (rewritten(pack(NS, KEY, payload, MAC_KEY), KEY_FIELD, KEY2), NS, KEY2),
        "namespace": (rewritten(pack(other_ns, KEY, payload, MAC_KEY), NS_FIELD, NS), NS, KEY),
    }
    for what, (blob, ns, key) in moved.items():
        assert page_format.header_view(blob) == (ns, key, len(payload)), what  # the rewrite took, CRCs agree
        assert unpack(blob, ns, key) == payload, what  # without a token nothing tells it apart
        with pytest.raises(PageFormatError) as err:
            unpack(blob, ns, key, MAC_KEY)
        assert err.value.reason == "bad_mac", what
