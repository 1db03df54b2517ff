"""Samplers: the cache changes nothing, the commit rule, batching, infilling, bad requests.

A tiny random-weight model with a large init std gives context-dependent (non-constant) greedy
outputs, so equality of token sequences is a meaningful check.
"""
import pytest
import torch

from setdiff_mega.diffusion import SetDLMObjective
from setdiff_mega.inference import (
    ARSampler,
    BD3LMSampler,
    Canvas,
    GenerationConfig,
    MDLMSampler,
    SetDLMSampler,
    commit_mask,
)

MASK, PAD, EOS = 60, 59, 58
PROMPTS = {
    "prompt": [[57, 1, 2, 3, 4, 5], [57, 9]],
    "bos_only": [[57], [57]],
    "infill": [[57, 1, 2, MASK, MASK, MASK, MASK, MASK, 7, 8, EOS], [57, 3, MASK, MASK, MASK, 4, EOS]],
}


class LetterTokenizer:
    """id i decodes to a letter (for the text stopping criteria)."""

    def decode(self, ids):
        return "".join(chr(65 + int(i) % 26) for i in ids)

    def token(self, i):
        return chr(65 + int(i) % 26)


def _run(cls, model, prompts, order_prior=None, tokenizer=None, **kw):
    kw.setdefault("max_new_tokens", 10)
    kw.setdefault("stop_at_eos", False)
    cfg = GenerationConfig(**kw)
    return cls(model, MASK, PAD, EOS, cfg, order_prior=order_prior, tokenizer=tokenizer).generate(
        Canvas.from_prompts(prompts, MASK, PAD, cfg.max_new_tokens))


@pytest.mark.parametrize("kind", list(PROMPTS))
@pytest.mark.parametrize("W", [1, 2, 4, 8])
@pytest.mark.parametrize("tau", [0.5, 0.9, 1.5])
def test_setdlm_cache_changes_nothing(rand_model, kind, W, tau):
    a = _run(SetDLMSampler, rand_model, PROMPTS[kind], window=W, tau=tau, use_cache=True)
    b = _run(SetDLMSampler, rand_model, PROMPTS[kind], window=W, tau=tau, use_cache=False)
    assert a.tokens == b.tokens and a.history == b.history
    assert all(len(t) > 0 for t in a.tokens)


@pytest.mark.parametrize("kind", list(PROMPTS))
@pytest.mark.parametrize("cls,kw", [(ARSampler, {}), (BD3LMSampler, {"block_size": 4, "tau": 0.5}),
                                    (BD3LMSampler, {"block_size": 3, "tau": 1.5})])
def test_baselines_cache_changes_nothing(rand_model, kind, cls, kw):
    a = _run(cls, rand_model, PROMPTS[kind], use_cache=True, **kw)
    b = _run(cls, rand_model, PROMPTS[kind], use_cache=False, **kw)
    assert a.tokens == b.tokens


def test_outputs_are_not_trivial(rand_model):
    out = _run(SetDLMSampler, rand_model, PROMPTS["prompt"], window=4, tau=0.9)
    assert len(set(out.tokens[0])) > 2


@pytest.mark.parametrize("W", [1, 4, 8])
def test_tau_above_one_commits_exactly_one_token_per_step(rand_model, W):
    out = _run(SetDLMSampler, rand_model, PROMPTS["prompt"], window=W, tau=1.5, max_new_tokens=12)
    assert all(n in (0, 1) for step in out.history for n in step)
    assert out.steps == [12, 12] and out.tokens_per_step == [1.0, 1.0]


def test_lower_tau_never_commits_fewer_on_the_same_logits():
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        conf = torch.rand(6, 9, generator=g)
        active = torch.rand(6, 9, generator=g) < 0.7
        counts = [commit_mask(conf, active, tau).sum(1) for tau in (1.5, 0.9, 0.7, 0.5, 0.2, 0.0)]
        for hi, lo in zip(counts, counts[1:]):
            assert (lo >= hi).all()
        one = commit_mask(conf, active, 1.5)
        assert torch.equal(one.sum(1), active.any(1).long())          # top-1 when tau > 1
        assert not (commit_mask(conf, active, 0.0) & ~active).any()   # only active positions


def test_leftmost_rule_forces_the_leftmost_active_positions_and_thresholds_the_rest():
    """commit_rule="leftmost": the k leftmost active positions always, every other one only at conf >= tau; the
    same threshold set as the paper's rule, only the forced commits differ."""
    g = torch.Generator().manual_seed(1)
    for _ in range(50):
        conf = torch.rand(6, 9, generator=g)
        active = torch.rand(6, 9, generator=g) < 0.6
        for k in (1, 2):
            for tau in (1.5, 0.7, 0.3):
                got = commit_mask(conf, active, tau, k, "leftmost")
                first_k = active & (active.long().cumsum(1) <= k)
                assert torch.equal(got, first_k | (active & (conf >= tau)))
                paper = commit_mask(conf, active, tau, k)
                assert torch.equal(got & ~first_k, paper & ~first_k & (conf >= tau))
    with pytest.raises(ValueError, match="commit_rule=.random. must be one of auto, confidence, leftmost"):
        GenerationConfig(commit_rule="random").validate()


def test_committed_tokens_never_change(rand_model):
    out = _run(SetDLMSampler, rand_model, PROMPTS["prompt"] + PROMPTS["infill"][:1], window=4, tau=0.5,
               record=True)
    prev = None
    for canvas in out.trace:
        if prev is not None:
            fixed = prev != MASK
            assert torch.equal(canvas[fixed], prev[fixed])
        prev = canvas
    assert (out.trace[-1][:, :6] != MASK).all()


@pytest.mark.parametrize("cls,kw", [(SetDLMSampler, {"window": 4, "tau": 0.5}), (ARSampler, {}),
                                    (BD3LMSampler, {"block_size": 4, "tau": 0.5})])
def test_record_gives_each_tokens_commit_call_and_confidence(rand_model, cls, kw):
    """record=True: per generated token, the commit call that wrote it (the canvas trace agrees) and its
    confidence (the probability of the chosen token, in (0, 1]); the tokens are those of an unrecorded run."""
    prompts = PROMPTS["prompt"] + PROMPTS["infill"][:1]
    out = _run(cls, rand_model, prompts, record=True, **kw)
    assert out.tokens == _run(cls, rand_model, prompts, **kw).tokens
    start = Canvas.from_prompts(prompts, MASK, PAD, 10)
    for b in range(len(prompts)):
        steps, conf = out.commit_steps[b], out.confidences[b]
        assert len(steps) == len(conf) == len(out.tokens[b]) > 0
        assert all(0.0 < c <= 1.0 for c in conf)
        gen = start.generate[b].nonzero().flatten().tolist()[:len(steps)]     # the generated positions, in order
        assert steps == [next(i for i, t in enumerate(out.trace) if t[b, p] != MASK) for p in gen]
    if cls is ARSampler:
        assert all(s == sorted(s) for s in out.commit_steps)             # left to right


@pytest.mark.parametrize("cls,kw", [(SetDLMSampler, {"window": 4, "tau": 0.5}),
                                    (SetDLMSampler, {"window": 2, "tau": 1.5}), (ARSampler, {}),
                                    (BD3LMSampler, {"block_size": 4, "tau": 0.5}),
                                    (MDLMSampler, {"block_size": 4, "tau": 0.5})])
def test_batched_equals_separate_batch_one_runs(rand_model, cls, kw):
    prompts = PROMPTS["prompt"] + PROMPTS["infill"] + [[57, 11, 12]]
    batched = _run(cls, rand_model, prompts, **kw)
    for i, p in enumerate(prompts):
        single = _run(cls, rand_model, [p], **kw)
        assert batched.tokens[i] == single.tokens[0], (cls.__name__, i)


@torch.no_grad()
def test_window_one_decoding_matches_training_queries(rand_model):
    """W = 1, tau > 1 decodes left to right; each token is the argmax of the training-time noisy query
    (SetDLM objective, identity order) evaluated on the final sequence."""
    out = _run(SetDLMSampler, rand_model, [[57, 1, 2, 3]], window=1, tau=2.0, max_new_tokens=8)
    seq = torch.tensor([out.sequences[0]])
    L = seq.shape[1]
    obj = SetDLMObjective(MASK, D=1)
    inp = obj.build_inputs(seq, perm=torch.arange(L)[None])
    logits = rand_model(inp.tokens, inp.position_ids, inp.attention_mask, inp.logits_start)
    logits[..., MASK] = float("-inf")
    assert logits.argmax(-1)[0, 4:].tolist() == out.tokens[0]


def test_infill_sees_the_right_context(rand_model):
    a = _run(SetDLMSampler, rand_model, [[57, 1, 2, MASK, MASK, MASK, 7, 8, EOS]], window=4, tau=1.5)
    b = _run(SetDLMSampler, rand_model, [[57, 1, 2, MASK, MASK, MASK, 30, 31, EOS]], window=4, tau=1.5)
    assert a.tokens != b.tokens            # different suffixes change the infill
    assert len(a.tokens[0]) == 3 and a.sequences[0][-3:] == [7, 8, EOS]


def test_eos_stops_plain_prompts(rand_model):
    out = _run(SetDLMSampler, rand_model, [[57, 1]], window=1, tau=2.0, max_new_tokens=6)
    first = out.tokens[0][0]
    # make the first generated token the EOS id: decoding must stop right after it
    eos_out = SetDLMSampler(rand_model, MASK, PAD, first, GenerationConfig(max_new_tokens=6, window=1, tau=2.0)) \
        .generate(Canvas.from_prompts([[57, 1]], MASK, PAD, 6))
    assert eos_out.tokens[0] == [first]


L_TRAIN = 16       # the random model's "training length" in the context tests below


@pytest.mark.parametrize("cls,kw", [(SetDLMSampler, {"window": 4, "tau": 0.5}),
                                    (SetDLMSampler, {"window": 1, "tau": 2.0}),
                                    (SetDLMSampler, {"window": 4, "tau": 0.7, "fht_cache_order": True}),
                                    (ARSampler, {}), (BD3LMSampler, {"block_size": 4, "tau": 0.5})])
def test_generation_of_three_training_lengths_is_cache_exact(rand_model, cls, kw):
    """3 L tokens from a model of length L: the cache keeps cache + chunk <= L (evicting), positions grow past
    L - 1, and the uncached reference (history recomputed with the cache's visibility) gives the same tokens."""
    prior = SetDLMObjective(MASK, D=4) if kw.get("fht_cache_order") else None
    outs = []
    for use_cache in (True, False):
        cfg = GenerationConfig(max_new_tokens=3 * L_TRAIN, stop_at_eos=False, context_length=L_TRAIN,
                               use_cache=use_cache, **kw)
        sampler = cls(rand_model, MASK, PAD, EOS, cfg, order_prior=prior)
        canvas = Canvas.from_prompts([[57, 1, 2], [57, 9, 8, 7, 6, 5]], MASK, PAD, cfg.max_new_tokens)
        outs.append(sampler.generate(canvas))
    on, off = outs
    assert on.tokens == off.tokens and on.history == off.history
    assert [len(t) for t in on.tokens] == [3 * L_TRAIN] * 2
    assert on.evicted > 0 and on.evicted == off.evicted
    unbounded = _run(cls, rand_model, [[57, 1, 2]], max_new_tokens=3 * L_TRAIN, order_prior=prior, **kw) \
        if cls is not SetDLMSampler or not kw.get("fht_cache_order") else None
    if unbounded is not None:                     # the crop changes the continuation once the context is full
        assert unbounded.tokens[0][:L_TRAIN - 8] == on.tokens[0][:L_TRAIN - 8]
        assert unbounded.tokens[0] != on.tokens[0]


def _chunk(c, k):
    """Put k / v [B, g, T, d] into the cache as the last forward's chunk (what attend() does)."""
    c._room(k.shape[2])
    s = c.offset + c.capacity
    c.k[0, :, :, s:s + k.shape[2]] = k
    c.v[0, :, :, s:s + k.shape[2]] = k
    c._T = k.shape[2]


def test_kv_cache_commit_and_keep():
    from setdiff_mega.inference import KVCache

    c = KVCache(num_layers=1, batch=2, groups=1, head_dim=2, capacity=4)
    k = torch.arange(2 * 3 * 2, dtype=torch.float32).view(2, 1, 3, 2)
    _chunk(c, k)
    c.commit(torch.tensor([2, 3]))
    assert c.length.tolist() == [2, 3]
    c.keep(torch.tensor([[True, True, True, True], [False, True, False, True]]))     # row 1 drops slots 0 and 2
    assert c.length.tolist() == [2, 1] and c.offset == 0
    assert torch.equal(c.window(0)[0][1, 0, 0], k[1, 0, 1])                          # old slot 1 moved to slot 0
    _chunk(c, k + 100)
    c.commit(torch.tensor([2, 3]))
    assert c.length.tolist() == [4, 4] and torch.equal(c.window(0)[0][1, 0, 1], k[1, 0, 0] + 100)
    assert c.valid().tolist() == [[True] * 4, [True] * 4]
    _chunk(c, k)
    with pytest.raises(ValueError, match="overflows"):
        c.commit(torch.tensor([1, 0]))
    before = c.window(0)[0].clone()
    c.keep(torch.tensor([[False, True, True, True], [False, True, True, True]]))     # the oldest entry of each row
    assert c.offset == 1 and c.length.tolist() == [3, 3]                             # no copy: the window moved
    assert torch.equal(c.window(0)[0][:, :, :3], before[:, :, 1:])
    offsets = []
    for step in range(100):                                     # the window reaches the buffer's end and moves back
        _chunk(c, k + step)
        offsets.append(c.offset)
        c.commit(torch.tensor([1, 1]))
        c.keep(torch.tensor([[False, True, True, True]] * 2))
        assert torch.equal(c.window(0)[0][:, :, 2], (k + step)[:, :, 0])
    assert any(b < a for a, b in zip(offsets, offsets[1:]))            # it moved back ...
    assert c.k.shape[3] == c.capacity + 64                          # ... in place: the buffer never grew
    window = c.window(0)[0].clone()
    _chunk(c, torch.zeros(2, 1, 100, 2))                            # a chunk larger than the room: it grows
    assert c.k.shape[3] == c.capacity + 100 + 64 and torch.equal(c.window(0)[0], window)


def test_kv_cache_commit_per_row_equals_the_scatter():
    """Rows committing different counts at different lengths: the CPU's per-row slice copies leave the same
    windows as the accelerator's scatter (both run here on CPU)."""
    from setdiff_mega.inference import KVCache

    g = torch.Generator().manual_seed(0)
    caches = [KVCache(num_layers=3, batch=5, groups=2, head_dim=4, capacity=12) for _ in range(2)]
    for step in range(6):
        k = torch.randn(3, 5, 2, 4, 4, generator=g)
        n = torch.randint(0, 5, (5,), generator=g)
        n[0] = step % 3                                         # rows differ, one sometimes commits nothing
        for c, path in zip(caches, ("_commit_rows", "_commit_scatter")):
            n_c = torch.minimum(n, c.capacity - c.length)
            c._room(4)
            s = c.offset + c.capacity
            c.k[:, :, :, s:s + 4], c.v[:, :, :, s:s + 4] = k, -k
            counts, lengths = torch.stack([n_c, c.length]).tolist()
            getattr(c, path)(*((counts, lengths) if path == "_commit_rows" else (n_c, 4)))
            c.length = c.length + n_c
        a, b = caches
        assert a.length.tolist() == b.length.tolist()
        for layer in range(3):
            for x, y in zip(a.window(layer), b.window(layer)):
                assert torch.equal(x * a.valid()[:, None, :, None], y * b.valid()[:, None, :, None])
    assert caches[0].length.max() > 4 and caches[0].length.min() < caches[0].length.max()


def test_sampled_decoding_is_seeded_and_cache_exact(rand_model):
    kw = dict(window=4, tau=0.7, temperature=1.0, top_p=0.9, max_new_tokens=12)
    a = _run(SetDLMSampler, rand_model, PROMPTS["prompt"], use_cache=True, seed=3, **kw)
    b = _run(SetDLMSampler, rand_model, PROMPTS["prompt"], use_cache=False, seed=3, **kw)
    c = _run(SetDLMSampler, rand_model, PROMPTS["prompt"], use_cache=True, seed=4, **kw)
    assert a.tokens == b.tokens            # same draws in the same order with or without the cache
    assert a.tokens != c.tokens            # and the seed matters


def test_top_p_keeps_the_crossing_token_and_drops_the_tail():
    from setdiff_mega.inference import choose_tokens

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).expand(4000, 4)
    g = torch.Generator().manual_seed(0)
    tok, conf = choose_tokens(logits, [], temperature=1.0, top_p=0.6, generator=g)
    assert set(tok.tolist()) == {0, 1}                     # 0.5 < 0.6, so 0.3 (the crossing token) stays
    assert torch.allclose(conf[tok == 0], torch.tensor(0.5 / 0.8))
    greedy, gconf = choose_tokens(logits[:1], [0])          # a banned class is never chosen
    assert greedy.item() == 1 and gconf.item() == pytest.approx(0.6)


ALL_OPTIONS = dict(repetition_penalty=1.3, length_penalty=(3, 1.5), top_p=0.9, context_length=L_TRAIN,
                   max_new_tokens=40)
STOPS = dict(min_new_tokens=4, stop_at_eos=True, stop_repeat=3, stop_confidence=0.02, stop_patience=2,
             stop_entropy=0.3, stop_entropy_window=6, stop_regex="[A-D][E-H]", stop_regex_count=2,
             stop_strings=("QQ",))
OPTION_PROMPTS = [[57, 1, 2, 3], [57, 9], [57, 1, 2, MASK, MASK, MASK, MASK, MASK, 7, 8, EOS],
                  [57, 3, MASK, MASK, 4, MASK, MASK, 5, EOS]]


@pytest.mark.parametrize("stops", [True, False])
@pytest.mark.parametrize("cls,kw", [(SetDLMSampler, {"window": 4, "tau": 0.5, "fht_cache_order": True}),
                                    (SetDLMSampler, {"window": 3, "tau": 0.7, "infill_full_context": False}),
                                    (ARSampler, {}), (BD3LMSampler, {"block_size": 4, "tau": 0.5}),
                                    (MDLMSampler, {"block_size": 4, "tau": 0.5})])
def test_every_option_is_cache_exact_and_batch_invariant(rand_model, cls, kw, stops):
    """Processors, nucleus, the context crop, FHT order, prefix-only infill and (stops=True) the stopping
    criteria all enabled: cache on == cache off, and a batch decodes every row as it would alone. Without the
    criteria every plain row runs past L (evictions); with them some row stops early."""
    prior = SetDLMObjective(MASK, D=4)
    opts = {**ALL_OPTIONS, **kw, **(STOPS if stops else {})}
    tok = LetterTokenizer()
    batched = _run(cls, rand_model, OPTION_PROMPTS, order_prior=prior, tokenizer=tok, **opts)
    if cls is not MDLMSampler:
        uncached = _run(cls, rand_model, OPTION_PROMPTS, order_prior=prior, tokenizer=tok, use_cache=False, **opts)
        assert batched.tokens == uncached.tokens and batched.history == uncached.history
    for i, p in enumerate(OPTION_PROMPTS):
        single = _run(cls, rand_model, [p], order_prior=prior, tokenizer=tok, **opts)
        assert single.tokens[0] == batched.tokens[i], (cls.__name__, i)
    assert all(len(t) > 0 for t in batched.tokens)
    if stops:
        assert min(len(t) for t in batched.tokens[:2]) < 40
    else:
        assert [len(t) for t in batched.tokens[:2]] == [40, 40] and (cls is MDLMSampler or batched.evicted > 0)
