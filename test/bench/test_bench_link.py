"""The P/D link the benchmark judges the KV transfer against (bench/link.py)."""

from pdserve.bench.link import all_on_loopback, kv_bytes_received, kv_link, loopback_bandwidth

ROUTER_INFO = {"internal_states": [{"kv_bytes_received": 1000}, {"kv_bytes_received": 500}],
               "prefill": [{"url": "http://127.0.0.1:30001"}], "decode": [{"url": "http://localhost:30002"}]}


def test_kv_bytes_add_up_over_the_decode_servers_and_are_none_without_the_counter():
    assert kv_bytes_received(ROUTER_INFO) == 1500
    assert kv_bytes_received({"internal_states": [{"num_running_reqs": 0}]}) is None
    assert kv_bytes_received(None) is None


def test_loopback_means_the_target_and_every_worker():
    assert all_on_loopback("http://127.0.0.1:8000", ROUTER_INFO)
    remote = {**ROUTER_INFO, "decode": [{"url": "http://10.0.0.2:30002"}]}
    assert not all_on_loopback("http://127.0.0.1:8000", remote)
    assert not all_on_loopback("http://10.0.0.1:8000", None)


def test_the_link_is_the_flag_else_the_measured_loopback_else_unknown():
    given = kv_link("http://10.0.0.1:8000", ROUTER_INFO, 500, link_gbps=25.0)
    assert (given.kv_bytes, given.bandwidth, given.source) == (1000, 25.0 / 8e-9, "--kv-link-gbps")
    loop = kv_link("http://127.0.0.1:8000", ROUTER_INFO, 0, link_gbps=None)
    assert loop.source == "loopback, measured" and loop.bandwidth > 0
    remote = kv_link("http://10.0.0.1:8000", ROUTER_INFO, 0, link_gbps=None)
    assert remote.kv_bytes == 1500 and remote.bandwidth is None
    assert kv_link("http://127.0.0.1:8000", {"internal_states": []}, None, None).kv_bytes is None


def test_the_loopback_probe_moves_its_bytes():
    assert loopback_bandwidth(8 << 20) > 10e6  # any loopback moves more than 10 MB/s
