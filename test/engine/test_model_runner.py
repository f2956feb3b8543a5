"""ModelRunner.build_forward_batch: the decode batch built as one tensor (one token per request) gives
what the per-list build gives, field by field, and its fields share no element."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pdserve.engine.model_runner import ModelRunner, ScheduledBatch
from pdserve.layers.forward_batch import ForwardMode
from pdserve.mem.page_table import ReqToTokenTable


def _runner():
    """What build_forward_batch reads of a runner (no model: the batch is built on the host)."""
    return SimpleNamespace(device=torch.device("cpu"), pool=None, backend=None, layer_hook=None)


def _table(rows: list[int], lens: list[int]) -> torch.Tensor:
    table = ReqToTokenTable(8, 64, page_size=4)
    for row, n in zip(rows, lens):
        table.write(row, 0, [1000 * row + p for p in range(n)])
    return table.table


@pytest.mark.parametrize("mode, ids, pos, loc, prefix, ext", [
    # decode: one token per request, the [6, B] one-tensor build
    (ForwardMode.DECODE, [11, 12, 13], [5, 9, 2], [105, 209, 302], [5, 9, 2], [1, 1, 1]),
    # extend: two requests, five tokens, one tensor per list
    (ForwardMode.EXTEND, [1, 2, 3, 4, 5], [0, 1, 2, 0, 1], [100, 101, 102, 300, 301], [0, 0], [3, 2]),
])
def test_the_batch_holds_each_list_and_its_fields_share_no_element(mode, ids, pos, loc, prefix, ext):
    rows = [1, 2, 3][:len(prefix)]
    table = _table(rows, [p + e for p, e in zip(prefix, ext)])
    batch = ScheduledBatch(mode, ids, pos, loc, prefix, ext, rows)
    fb = ModelRunner.build_forward_batch(_runner(), batch, table)  # type: ignore[arg-type]
    seq = [p + e for p, e in zip(prefix, ext)]
    fields = {"input_ids": ids, "positions": pos, "out_cache_loc": loc, "prefix_lens": prefix, "extend_lens": ext,
              "seq_lens": seq}
    for name, want in fields.items():
        got = getattr(fb, name)
        assert got.dtype == torch.int64 and got.tolist() == want, name
    assert fb.kv_slots.tolist() == [table[r, :max(seq)].tolist() for r in rows]
    assert fb.req_rows == tuple(rows)
    # the overlap worker fills input_ids in place (the previous step's tokens): nothing else may move
    fb.input_ids.fill_(-1)
    assert all(getattr(fb, name).tolist() == want for name, want in fields.items() if name != "input_ids")


def test_write_one_each_sets_one_slot_per_row():
    table = ReqToTokenTable(4, 16, page_size=4)
    table.write_one_each([2, 0, 3], [5, 0, 15], [77, 88, 99])
    assert table.table[2, 5] == 77 and table.table[0, 0] == 88 and table.table[3, 15] == 99
    assert int(table.table.count_nonzero()) == 3
