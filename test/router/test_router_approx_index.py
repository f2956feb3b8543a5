"""The router's guess of a worker's cache (pure): chained block hashes it routed there, LRU-evicted
at the worker's pool size from the tail of each chain; text blocks when there is no tokenizer."""

from __future__ import annotations

import pytest

from pdserve.router.approx_index import ApproxIndex, text_block_hashes
from pdserve.router.kv_index import prompt_block_hashes
from pdserve.router.prompt_tokens import prompt_text


def test_insert_then_match_the_leading_chain_only():
    index = ApproxIndex(100)
    a = prompt_block_hashes(list(range(10, 30)), 4)  # 19 usable tokens: 4 full pages
    assert len(a) == 4 and index.matched_blocks(a) == 0
    index.insert(a)
    assert index.matched_blocks(a) == 4 and index.num_blocks == 4
    longer = prompt_block_hashes(list(range(10, 30)) + [7, 7, 7, 7, 7], 4)
    assert longer[:4] == a and index.matched_blocks(longer) == 4  # the next turn: its history
    other = prompt_block_hashes([1, 2, 3, 4] + list(range(14, 30)), 4)  # first page differs: a new chain
    assert index.matched_blocks(other) == 0
    assert index.matched_blocks([a[0], 12345, a[2]]) == 1  # stops at the first miss


def test_lru_evicts_at_the_pool_size_from_the_tail_of_the_oldest_chain():
    index = ApproxIndex(4)
    old, new = [11, 12, 13], [21, 22, 23]  # chains: 11 -> 12 -> 13, 21 -> 22 -> 23
    index.insert(old)
    index.insert(new)
    assert index.num_blocks == 4 and index.evicted == 2
    assert index.matched_blocks(new) == 3
    assert index.matched_blocks(old) == 1  # 13 then 12 went first: the prefix 11 is still whole
    index.insert(old[:1])  # routed again (a prompt of one block): 11 is the most recent now
    index.insert([31, 32])
    assert index.matched_blocks(old) == 1 and index.matched_blocks([31, 32]) == 2
    assert index.matched_blocks(new) == 1  # the oldest blocks went: 23 and 22
    assert len(index) <= index.capacity


def test_matching_does_not_refresh_and_resizing_shrinks():
    index = ApproxIndex(3)
    index.insert([1, 2])
    index.insert([5])
    assert index.matched_blocks([1, 2]) == 2  # a match is not a use: the worker was not sent it
    index.insert([6, 7])  # 5 blocks into 3: 2 then 1 go (the oldest)
    assert index.matched_blocks([1, 2]) == 0 and index.matched_blocks([5]) == 1
    index.resize(1)
    assert index.num_blocks == 1 and index.matched_blocks([6]) == 1
    with pytest.raises(ValueError, match="capacity"):
        index.resize(0)


def test_text_blocks_are_prefix_stable_and_full_blocks_only():
    text = "The lighthouse keeper fed the sea birds every morning."
    h = text_block_hashes(text, 8)
    assert len(h) == len(text) // 8
    assert text_block_hashes(text + " And then the storm came.", 8)[:len(h)] == h
    assert text_block_hashes("X" + text[1:], 8)[0] != h[0]
    assert text_block_hashes("short", 8) == []
    assert text_block_hashes("é" * 16, 8) == text_block_hashes("é" * 16, 8)  # characters, not bytes
    with pytest.raises(ValueError, match="block_chars"):
        text_block_hashes(text, 0)


def test_a_conversation_s_next_turn_extends_its_text():
    turn1 = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story."}]
    turn2 = turn1 + [{"role": "assistant", "content": "Once upon a time."},
                     {"role": "user", "content": [{"type": "text", "text": "Go on."}]}]
    first, second = prompt_text("/v1/chat/completions", {"messages": turn1}), \
        prompt_text("/v1/chat/completions", {"messages": turn2})
    assert first and second and second.startswith(first) and "Go on." in second
    assert prompt_text("/generate", {"text": "hi"}) == "hi"
    assert prompt_text("/v1/completions", {"prompt": "hi"}) == "hi"
    assert prompt_text("/v1/completions", {"prompt": ["a", "b"]}) is None  # a batch: routed by load
    assert prompt_text("/v1/chat/completions", {"messages": "bad"}) is None



def _token_blocks(*blocks: list[int]) -> list[int]:
    return prompt_block_hashes([t for block in blocks for t in block] + [0], 4)  # the last token is never cached


def _text_blocks(*blocks: str) -> list[int]:
    return text_block_hashes("".join(blocks), 8)


@pytest.mark.parametrize("hashes, a, b, c", [(_token_blocks, [11] * 4, [22] * 4, [33] * 4),
                                             (_text_blocks, "a" * 8, "b" * 8, "c" * 8)], ids=["tokens", "text"])
def test_blocks_are_chained_so_order_matters(hashes, a, b, c):
    """A block's hash names the whole prefix up to it: the same blocks in another order, or a block
    after another history, are not what the worker was sent (unchained hashes would match both)."""
    index = ApproxIndex(100)
    index.insert(hashes(a, b))
    assert index.matched_blocks(hashes(a, b)) == 2
    assert index.matched_blocks(hashes(b, a)) == 0  # the same two blocks, swapped
    assert index.matched_blocks(hashes(a, c)) == 1
    assert hashes(c, b)[1] != hashes(a, b)[1]  # b after c is not b after a
