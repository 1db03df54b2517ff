"""Attention backends inside the model (fp32, CPU): every backend that runs here gives the dense-mask
reference's logits, loss and parameter gradients (relative 1e-5), with pinned context (prefix and suffix),
right padding and grouped KV heads; mask patterns describe exactly the masks the objectives build."""
import dataclasses

import pytest
import torch

from setdiff_mega.diffusion import masks as M
from setdiff_mega.diffusion.objectives import (
    ARObjective,
    BD3LMObjective,
    MDLMObjective,
    SetDLMObjective,
    build_inputs_per_sample,
)

MASK_ID = 60
L = 12


def _batch():
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 59, (3, L), generator=g)
    context = torch.zeros(3, L, dtype=torch.bool)
    context[0, :3] = True                  # pinned prefix (a prompt)
    context[1, :2] = True                  # prefix and suffix (infilling)
    context[1, -3:] = True
    padding = torch.zeros(3, L, dtype=torch.bool)
    padding[2, -4:] = True                 # right padding
    padding[1, -1:] = True
    context &= ~padding
    return x, context, padding


def _models(backends, **overrides):
    from setdiff_mega.config import ModelConfig
    from setdiff_mega.model import build_model

    mods = {}
    for b in backends:
        torch.manual_seed(0)
        mc = ModelConfig(**{"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "num_query_groups": 2,
                            "zero_init_head": False, "make_vocab_size_divisible_by": 8, "attention_backend": b,
                            **overrides})
        mods[b] = build_model(mc, 61)
    ref = mods[backends[0]].state_dict()
    for m in mods.values():
        m.load_state_dict(ref)
    return mods


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-12)).item()


def _rows(inp):
    """Logit rows that are real tokens (padding rows are nobody's input and never in a loss)."""
    pattern = inp.attention_pattern
    if pattern is None or pattern.key_valid is None:
        return torch.ones(inp.tokens.shape[0], inp.tokens.shape[1] - inp.logits_start, dtype=torch.bool)
    return pattern.key_valid[:, inp.logits_start:]


def _forward_backward(model, objective, inp):
    model.zero_grad(set_to_none=True)
    logits = model(**inp.model_kwargs())
    loss, _ = objective.loss(logits, inp)
    loss.backward()
    return logits.detach(), loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


OBJECTIVES = [SetDLMObjective(MASK_ID, D=3), BD3LMObjective(MASK_ID, block_size=3), BD3LMObjective(MASK_ID, 1),
              MDLMObjective(MASK_ID), ARObjective(MASK_ID)]


@pytest.mark.parametrize("objective", OBJECTIVES, ids=lambda o: f"{o.name}{getattr(o, 'block_size', '')}")
def test_patterns_describe_the_objectives_masks(objective):
    x, context, padding = _batch()
    inp = objective.build_inputs(x, context=context, padding=padding, generator=torch.Generator().manual_seed(0))
    pattern = inp.attention_pattern
    assert pattern is not None and pattern.length == inp.tokens.shape[1]
    torch.testing.assert_close(pattern.dense(), inp.attention_mask.expand_as(pattern.dense()))
    # the FlexAttention mask_mod evaluated on every (b, q, k) is the same mask
    T = pattern.length
    b, q, k = torch.meshgrid(torch.arange(3), torch.arange(T), torch.arange(T), indexing="ij")
    assert torch.equal(pattern.mask_mod()(b, 0, q, k), pattern.dense().expand(3, T, T))


def test_setdlm_pattern_is_static_setcausal_with_padding_last():
    x, context, padding = _batch()
    obj = SetDLMObjective(MASK_ID, D=3)
    inp = obj.build_inputs(x, context=context, padding=padding, generator=torch.Generator().manual_seed(0))
    p = inp.attention_pattern
    assert p.is_setcausal and p.valid_keys_first()
    # an independent construction: the static rank-space mask with the permuted padding
    valid = (~torch.gather(padding, 1, inp.extras["perm"])).repeat(1, 2)
    assert torch.equal(inp.attention_mask, M.with_key_padding(M.setcausal_mask(L), valid))
    bad = p.with_padding(valid.flip(-1))
    assert not bad.valid_keys_first()
    clean = obj.build_inputs(x, generator=torch.Generator().manual_seed(0))
    assert clean.attention_pattern is obj.build_inputs(x).attention_pattern     # one static pattern per shape
    merged = build_inputs_per_sample(obj, x, [0, 1, 2], seed=5)
    assert merged.attention_pattern is not None and merged.attention_pattern.key_valid is None


@pytest.mark.parametrize("objective", OBJECTIVES, ids=lambda o: f"{o.name}{getattr(o, 'block_size', '')}")
def test_setcausal_and_local_backends_match_the_dense_reference(mcore, objective):
    """Outputs, loss and gradients: SetDLM and BD3LM(S=1) run the decomposition, others fall back."""
    mods = _models(["sdpa", "setcausal", "local"])
    x, context, padding = _batch()
    inp = objective.build_inputs(x, context=context, padding=padding, generator=torch.Generator().manual_seed(0))
    rows = _rows(inp)
    ref_logits, ref_loss, ref_grads = _forward_backward(mods["sdpa"], objective, inp)
    for name in ("setcausal", "local"):
        logits, loss, grads = _forward_backward(mods[name], objective, inp)
        assert _rel(logits[rows], ref_logits[rows]) < 1e-5, name
        assert abs(loss - ref_loss) / abs(ref_loss) < 1e-5, name
        for n, g in grads.items():
            assert _rel(g, ref_grads[n]) < 1e-5, (name, n)


def test_setcausal_backend_really_decomposes(mcore, monkeypatch):
    """The set-causal pattern reaches the core attention and takes the decomposition, not the SDPA fallback."""
    from setdiff_mega.model import setcausal

    calls = []
    real = setcausal.setcausal_attention
    monkeypatch.setattr(setcausal, "setcausal_attention", lambda *a: calls.append(1) or real(*a))
    model = _models(["setcausal"])["setcausal"]
    x, context, padding = _batch()
    obj = SetDLMObjective(MASK_ID, D=3)
    model(**obj.build_inputs(x, context=context, padding=padding).model_kwargs())
    assert len(calls) == 2                                     # one per layer
    inp = obj.build_inputs(x, padding=padding)                 # padding first in rank order: must fall back
    inp.attention_pattern = inp.attention_pattern.with_padding(inp.attention_pattern.key_valid.flip(-1))
    inp.attention_mask = inp.attention_pattern.dense()
    model(**inp.model_kwargs())
    assert len(calls) == 2
    model(**ARObjective(MASK_ID).build_inputs(x).model_kwargs())
    assert len(calls) == 2


@pytest.mark.parametrize("objective", OBJECTIVES, ids=lambda o: f"{o.name}{getattr(o, 'block_size', '')}")
def test_flex_backend_forward_matches_the_dense_reference(mcore, objective):
    """CPU FlexAttention runs forward only (PyTorch has no CPU backward for it): logits on every row."""
    mods = _models(["sdpa", "flex"])
    x, context, padding = _batch()
    inp = objective.build_inputs(x, context=context, padding=padding, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = mods["sdpa"](**inp.model_kwargs())
        got = mods["flex"](**inp.model_kwargs())
    assert _rel(got, ref) < 1e-5
    assert any(k[0] == "flex_block_mask" for k in inp.attention_pattern.cache)    # built once, kept


def test_flex_backend_refuses_cpu_training_with_a_clear_error(mcore):
    model = _models(["flex"])["flex"]
    x, _, _ = _batch()
    inp = SetDLMObjective(MASK_ID, D=3).build_inputs(x)
    with pytest.raises(RuntimeError, match="no backward on CPU.*attention_backend=setcausal"):
        model(**inp.model_kwargs())


@pytest.mark.parametrize("objective", ["setdlm", "bd3lm"])
def test_mask_free_inputs_build_the_mask_from_the_pattern(mcore, objective):
    """Given a pattern the dense mask may be omitted: the layers get a placeholder; the set-causal
    decomposition never builds the mask, SDPA (BD3LM's block mask) builds it once for all layers."""
    from setdiff_mega.diffusion import build_objective

    mods = _models(["setcausal", "sdpa"])
    x, context, padding = _batch()
    inp = build_objective(objective, MASK_ID, D=3, block_size=2).build_inputs(x, context=context, padding=padding)
    for name, model in mods.items():
        model.eval()
        pattern = inp.attention_pattern
        pattern.cache.clear()
        with torch.no_grad():
            a = model(**inp.model_kwargs())
            b = model(**dataclasses.replace(inp, attention_mask=None).model_kwargs())
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
        built = any(k[0] == "dense_allowed" for k in pattern.cache)
        assert built == (name == "sdpa" or objective != "setdlm"), (name, objective)


@pytest.mark.parametrize("use_cache", [True, False])
def test_generation_is_the_same_with_every_backend(mcore, use_cache):
    """SetDLM decoding works on a model built with any backend and gives the same tokens (the samplers pass
    masks without a pattern, which every backend runs through SDPA; KV-cached steps attend through the cache)."""
    from setdiff_mega.inference import Canvas, GenerationConfig, SetDLMSampler

    mods = _models(["sdpa", "setcausal", "flex"], init_method_std=0.5)
    cfg = GenerationConfig(max_new_tokens=8, stop_at_eos=False, window=4, tau=0.9, use_cache=use_cache)
    outs = {}
    for name, model in mods.items():
        model.eval()
        with torch.no_grad():
            canvas = Canvas.from_prompts([[57, 1, 2, 3], [57, 9]], MASK_ID, 59, cfg.max_new_tokens)
            outs[name] = SetDLMSampler(model, MASK_ID, 59, 58, cfg).generate(canvas).tokens
    assert outs["setcausal"] == outs["sdpa"] and outs["flex"] == outs["sdpa"]


def test_structured_backends_say_when_they_fall_back(mcore):
    """Attention dropout: both structured backends run SDPA with the mask, and warn."""
    mods = _models(["setcausal", "flex"], attention_dropout=0.1)
    x, _, _ = _batch()
    inp = SetDLMObjective(MASK_ID, D=3).build_inputs(x)
    for name, model in mods.items():
        with pytest.warns(UserWarning, match=f"attention_backend={name} falls back"):
            model.train()(**inp.model_kwargs()).sum().backward()


def test_fused_path_self_check_guards_correctness(mcore, monkeypatch):
    """The one-time self-check passes for the real kernels, and a kernel that misbehaves (simulated: a
    perturbed log-sum-exp) is caught: the backend warns and runs the dense path, with reference results."""
    from setdiff_mega.model import setcausal

    setcausal.kernel_verified.cache_clear()
    assert setcausal.kernel_verified("cpu", torch.float32, 16)
    assert setcausal.kernel_verified("cpu", torch.bfloat16, 64)
    real = setcausal._flash_fwd
    monkeypatch.setattr(setcausal, "_flash_fwd", lambda *a: (lambda o, lse, aux: (o, lse + 0.5, aux))(*real(*a)))
    setcausal.kernel_verified.cache_clear()
    mods = _models(["sdpa", "setcausal"])
    x, context, padding = _batch()
    obj = SetDLMObjective(MASK_ID, D=3)
    inp = obj.build_inputs(x, context=context, padding=padding, generator=torch.Generator().manual_seed(0))
    with pytest.warns(UserWarning, match="self-check failed"):
        got = mods["setcausal"](**inp.model_kwargs())
    ref = mods["sdpa"](**inp.model_kwargs())
    assert torch.equal(got, ref)
    setcausal.kernel_verified.cache_clear()
