"""Lookahead (setdiff_mega/eval/lookahead.py) against hand-computed values: a scripted model predicts the token
``g[q]`` at absolute position q whatever the context, so which offsets are right is known for every prefix."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from setdiff_mega.config import ObjectiveConfig
from setdiff_mega.diffusion import build_objective
from setdiff_mega.eval import lookahead as LA

from .mock import ScriptedModel, peaked

V, MASK, PAD, EOS, BOS = 61, 60, 59, 58, 57
G = [q % 10 + 1 for q in range(40)]              # the scripted prediction at position q: tokens 1..10


def _setup(name, **options):
    model = ScriptedModel(peaked([[(g, 5.0)] for g in G], V))
    tok = SimpleNamespace(mask=MASK, pad=PAD, eos=EOS, bos=BOS, vocab_size=V, hash=None)
    cfg = SimpleNamespace(data=SimpleNamespace(seq_length=32), objective=ObjectiveConfig(name=name, **options))
    return model, tok, build_objective(name, MASK, **options), cfg


# record 1: prompt of 3, targets = the script at positions 3..8 but a token it never predicts at index 2;
# record 2: prompt of 2, targets = the script at positions 2..5 (a different length in the same batch)
PER = [([BOS, 11, 12], G[3:5] + [20] + G[6:9]), ([BOS, 11], G[2:6])]


def test_window_accuracy_runs_and_confidence_by_hand():
    model, tok, obj, cfg = _setup("setdlm", D=3)
    la = LA.measure_ids(model, tok, obj, cfg, PER, K=3, batch_size=4)
    # record 1 (A = 6): offset k at prefix j is wrong only where j + k = 2; record 2 (A = 4) is right everywhere
    assert la.count == [6 + 4, 5 + 3, 4 + 2]
    assert la.acc == pytest.approx([(5 + 4) / 10, (4 + 3) / 8, (3 + 2) / 6])
    # runs: record 1 j = 0..5 -> 2, 1, 0, 3, 2, 1; record 2 j = 0..3 -> 3, 3, 2, 1
    assert la.mean_run == pytest.approx((9 + 9) / 10) and la.steps == 10 and la.records == 2
    p = torch.softmax(peaked([[(1, 5.0)]], V)[0, :MASK], -1)[1].item()      # every prediction equally peaked
    assert la.conf == pytest.approx([p] * 3, abs=1e-3)
    one = LA.measure_ids(model, tok, obj, cfg, PER, K=3, batch_size=1)       # batching changes nothing
    assert (one.acc, one.count, one.mean_run) == (la.acc, la.count, la.mean_run)


def test_a_causal_model_looks_one_ahead_and_a_block_model_is_refused():
    model, tok, obj, cfg = _setup("ar")            # AR reads position q's token off row q - 1: the script shifted
    shifted = [([BOS, 11, 12], G[2:4] + [20] + G[5:8]), ([BOS, 11], G[1:5])]
    la = LA.measure_ids(model, tok, obj, cfg, shifted, K=4)
    assert la.K == 1 and la.acc == pytest.approx([0.9]) and la.mean_run == pytest.approx(0.9)
    with pytest.raises(LA.LookaheadError, match="BD3LM decodes aligned blocks"):
        LA.window_of("bd3lm", 4)
    model, tok, obj, cfg = _setup("setdlm", D=3)
    with pytest.raises(LA.LookaheadError, match="do not fit the model's length L = 32"):
        LA.measure_ids(model, tok, obj, cfg, [([BOS] * 25, G[:6])], K=3)


def test_targets_end_at_the_first_eos_and_one_turn_only():
    tok = SimpleNamespace(eos=EOS, bos=BOS, encode=lambda s: [ord(c) - 96 for c in s])
    fake = lambda ids, mask: SimpleNamespace(encode=lambda r, where: (np.array(ids), np.array(mask)))
    assert LA.targets(fake([BOS, 1, 2, 3, EOS, 9, EOS], [0, 0, 1, 1, 1, 1, 1]), tok, {}) == ([BOS, 1], [2, 3, EOS])
    assert LA.targets(None, tok, {"prompt": "ab", "response": "c"}) == ([BOS, 1, 2], [3, EOS])
    with pytest.raises(LA.LookaheadError, match="dev.jsonl:7: .*a single assistant turn"):
        LA.targets(fake([BOS, 1, 2, 3, 4], [0, 1, 0, 1, 1]), tok, {}, "dev.jsonl:7")
    seen = []                                   # the renderer's own errors name the record's place too
    spy = SimpleNamespace(encode=lambda r, where: seen.append(where()) or (np.array([BOS, 1]), np.array([0, 1])))
    LA.targets(spy, tok, {}, "dev.jsonl:9")
    assert seen == ["dev.jsonl:9"]
