"""A server started with speculative decoding: its HTTP responses carry the acceptance figures
(SGLang's meta_info keys) and /metrics counts the verifies."""

import pytest

from server_utils import Server


@pytest.fixture(scope="module")
def server():
    s = Server("--speculative-algorithm", "NEXTN", "--speculative-num-steps", "2", "--max-total-tokens", "2048",
               model="tiny-deepseek")
    try:
        yield s.start()
    finally:
        s.stop()


def test_generate_and_metrics_carry_the_speculative_figures(server):
    body = {"input_ids": [5, 17, 42, 99, 7, 12], "sampling_params": {"max_new_tokens": 8, "temperature": 0,
                                                                       "ignore_eos": True}}
    r = server.post("/generate", json=body)
    r.raise_for_status()
    meta = r.json()["meta_info"]
    assert meta["spec_verify_ct"] >= 1 and meta["spec_draft_token_num"] >= meta["spec_verify_ct"]
    assert 0 <= meta["spec_accept_rate"] <= 1 and meta["spec_accept_length"] >= 1
    metrics = server.get("/metrics").text
    line = next(x for x in metrics.splitlines() if x.startswith("pdserve:spec_verify_total"))
    assert float(line.split()[-1]) >= meta["spec_verify_ct"]
