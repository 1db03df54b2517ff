"""Cutting a scheduler step's padding (setdiff_mega/serving/fusion.py): which rows and calls go apart, and the
logits of a cut call back in its own layout."""
import torch

from setdiff_mega.decoding.cache import KVCache
from setdiff_mega.decoding.calls import Call
from setdiff_mega.serving.fusion import groups, split_rows, stitch


def _call(counts, P=6, A=3, C=4):
    b, T = len(counts), P + A
    cache = KVCache(1, b, 1, 2, C)
    return Call(torch.arange(b * T).view(b, T), torch.arange(T).repeat(b, 1), torch.ones(b, T, C + T, dtype=torch.bool),
                P, cache, torch.tensor(counts), P)


def test_a_joining_rows_prefill_goes_apart_only_when_it_saves_enough():
    call = _call([6, 1, 0, 2])                       # row 0 joins with 6 pending entries, the others decode
    parts = split_rows(call, min_saving=12)          # 3 rows x (6 - 2) = 12 row-positions saved
    assert len(parts) == 2
    (wide, rw, cw), (narrow, rn, cn) = parts
    assert rw.tolist() == [0] and rn.tolist() == [1, 2, 3]
    assert wide.width == 9 and narrow.width == 2 + 3 and narrow.start == 2 and narrow.pending_width == 2
    assert torch.equal(narrow.tokens, call.tokens[1:][:, [0, 1, 6, 7, 8]])
    assert narrow.keep.shape == (3, 5, 4 + 5)
    assert call.cache._T == 9                        # the full width is reserved before either forward
    assert len(split_rows(_call([6, 1, 0, 2]), min_saving=13)) == 1
    assert len(split_rows(_call([6, 6, 6]), min_saving=1)) == 1          # nothing to save


def test_stitch_puts_each_rows_logits_back_in_the_calls_layout():
    call = _call([6, 1, 0, 2])
    parts = split_rows(call, min_saving=1)
    V = 5
    outs = [(torch.full((p.rows, p.width - p.start, V), float(k + 1)), rows, cols)
            for k, (p, rows, cols) in enumerate(parts)]
    full = stitch(call, outs)
    assert full.shape == (4, 3, V)
    assert (full[0] == 1).all() and (full[1:] == 2).all()
    shifted = _call([6, 1, 0, 2])
    shifted.start = 0                                # logits for every column (a shifted head reads pending rows)
    parts = split_rows(shifted, min_saving=1)
    outs = [(torch.full((p.rows, p.width - p.start, V), 1.0), rows, cols) for p, rows, cols in parts]
    full = stitch(shifted, outs)
    assert full.shape == (4, 9, V)
    assert (full[1:, 2:6] == 0).all() and (full[1:, :2] == 1).all() and (full[1:, 6:] == 1).all()


def test_calls_of_a_step_go_to_two_forwards_by_width_when_that_saves_enough():
    a, b, c = _call([6]), _call([1, 1]), _call([0, 2, 1])
    b.tokens, c.tokens = b.tokens[:, :4], c.tokens[:, :3]            # widths 9, 4, 3
    assert groups([a, b, c], min_saving=1) == [[0], [1, 2]]        # (2 + 3) rows x (9 - 4) = 25 saved
    assert groups([a, b, c], min_saving=26) == [[0, 1, 2]]
    assert groups([a], min_saving=1) == [[0]]
