"""The megatron-core model with the set-diffusion objectives (single rank, fp32, random weights)."""
import pytest
import torch

from setdiff_mega.diffusion import (
    ARObjective,
    BD3LMObjective,
    MDLMObjective,
    SetDLMObjective,
    invert,
    masked_token_nll,
    setcausal_mask_from_ranks,
)

from ..conftest import MASK_ID

L = 12


def _x(B=3, seed=0):
    return torch.randint(0, 58, (B, L), generator=torch.Generator().manual_seed(seed))


def _run(model, inp):
    return model(inp.tokens, inp.position_ids, inp.attention_mask, inp.logits_start)


@torch.no_grad()
def test_shapes_and_head_only_on_requested_rows(tiny_model):
    inp = SetDLMObjective(MASK_ID, D=2).build_inputs(_x(), generator=torch.Generator().manual_seed(0))
    full = tiny_model(inp.tokens, inp.position_ids, inp.attention_mask, 0)
    half = _run(tiny_model, inp)
    assert full.shape == (3, 2 * L, 61) and half.shape == (3, L, 61)
    assert torch.allclose(half, full[:, L:], atol=1e-6)


@torch.no_grad()
def test_setdlm_d1_equals_left_to_right_autoregressive_factorisation(tiny_model):
    """SetDLM with D = 1 is AR: identity order, and its loss equals -1/L sum_r log p(x_r | x_<r)
    evaluated prefix by prefix with plain causal attention over [x_0..x_{r-1}, MASK@r]."""
    x = _x(B=2)
    obj = SetDLMObjective(MASK_ID, D=1)
    inp = obj.build_inputs(x, generator=torch.Generator().manual_seed(0))
    assert torch.equal(inp.extras["perm"], torch.arange(L).expand(2, L))
    loss, _ = obj.loss(_run(tiny_model, inp), inp)
    nll = torch.zeros(2, L)
    for r in range(L):
        toks = torch.cat([x[:, :r], torch.full((2, 1), MASK_ID)], 1)
        pos = torch.arange(r + 1).expand(2, r + 1)
        causal = torch.ones(r + 1, r + 1, dtype=torch.bool).tril()[None]
        logit = tiny_model(toks, pos, causal, r)                  # the MASK query's logits
        nll[:, r] = masked_token_nll(logit, x[:, r:r + 1], MASK_ID)[:, 0]
    assert loss.item() == pytest.approx(nll.mean(1).mean().item(), rel=1e-5)


@torch.no_grad()
def test_permuted_layout_equals_rank_mask_in_original_positions(tiny_model):
    """Static mask on permuted tokens == rank-based mask on unpermuted tokens (needs per-sample RoPE)."""
    x = _x(B=3, seed=1)
    obj = SetDLMObjective(MASK_ID, D=4)
    inp = obj.build_inputs(x, generator=torch.Generator().manual_seed(3))
    perm = inp.extras["perm"]
    assert not torch.equal(perm, torch.arange(L).expand_as(perm))
    out_perm = _run(tiny_model, inp)                              # [B, L] in rank order
    toks = torch.cat([x, torch.full_like(x, MASK_ID)], 1)
    pos = torch.arange(L).repeat(2).expand(3, 2 * L)
    out_orig = tiny_model(toks, pos, setcausal_mask_from_ranks(invert(perm)), L)   # original order
    assert torch.allclose(out_perm, out_orig.gather(1, perm[..., None].expand_as(out_orig)), atol=1e-5)


@torch.no_grad()
def test_rope_uses_given_positions(tiny_model):
    x = _x()
    inp = ARObjective(MASK_ID).build_inputs(x)
    a = _run(tiny_model, inp)
    # RoPE is relative: a common shift of every position changes nothing ...
    shifted = tiny_model(inp.tokens, inp.position_ids + 7, inp.attention_mask, 0)
    assert torch.allclose(a, shifted, atol=1e-4)
    # ... but moving one token's position does (megatron-core alone would ignore position_ids)
    pos = inp.position_ids.clone()
    pos[:, 3] = 40
    moved = tiny_model(inp.tokens, pos, inp.attention_mask, 0)
    assert not torch.allclose(a[:, 3:], moved[:, 3:], atol=1e-4)
    assert torch.allclose(a[:, :3], moved[:, :3], atol=1e-5)      # causal: earlier rows unaffected


@torch.no_grad()
def test_noisy_query_is_blind_to_its_own_and_later_clean_tokens(tiny_model):
    x = _x(B=1, seed=2)
    obj = SetDLMObjective(MASK_ID, D=4)
    inp = obj.build_inputs(x, generator=torch.Generator().manual_seed(0))
    base = _run(tiny_model, inp)
    r = 5
    changed = inp.tokens.clone()
    changed[0, r] = (changed[0, r] + 1) % 58                      # change the clean token at rank r
    out = tiny_model(changed, inp.position_ids, inp.attention_mask, L)
    diff = (out - base).abs().amax(-1)[0]
    assert diff[: r + 1].max() < 1e-6                              # ranks <= r cannot see it
    assert diff[r + 1:].min() > 1e-6                               # every later rank does


@pytest.mark.parametrize("objective", [ARObjective(MASK_ID), MDLMObjective(MASK_ID),
                                       BD3LMObjective(MASK_ID, block_size=4), SetDLMObjective(MASK_ID, D=2)])
def test_every_objective_trains_a_step(tiny_model, objective):
    model = tiny_model.train()
    inp = objective.build_inputs(_x(), generator=torch.Generator().manual_seed(0))
    loss, st = objective.loss(_run(model, inp), inp)
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert torch.isfinite(loss) and grads and all(torch.isfinite(g).all() for g in grads)
    assert st["num_tokens"] > 0


@torch.no_grad()
def test_sdpa_backend_matches_mcore_local_attention(mcore):
    from setdiff_mega.config import ModelConfig
    from setdiff_mega.model import build_model

    mods = []
    for backend in ("sdpa", "local"):
        torch.manual_seed(0)
        mc = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, zero_init_head=False,
                         attention_backend=backend, make_vocab_size_divisible_by=8)
        mods.append(build_model(mc, 61).eval())
    mods[1].load_state_dict(mods[0].state_dict())
    x = _x()
    pad = torch.zeros_like(x, dtype=torch.bool)
    pad[0, -3:] = True
    for obj in (SetDLMObjective(MASK_ID, D=4), BD3LMObjective(MASK_ID, block_size=3), MDLMObjective(MASK_ID)):
        inp = obj.build_inputs(x, padding=pad, generator=torch.Generator().manual_seed(0))
        a, b = _run(mods[0], inp), _run(mods[1], inp)
        assert torch.allclose(a, b, atol=1e-5), obj.name


def test_cpu_shim_is_active_and_idempotent(mcore):
    from setdiff_mega.compat import mcore_cpu

    assert mcore_cpu.is_applied() == (not torch.cuda.is_available())
    mcore_cpu.apply()
    mcore_cpu.check_targets()


def test_cpu_path_never_imports_transformer_engine(tiny_model):
    import sys

    from setdiff_mega.model.spec import resolve_impl

    assert "transformer_engine" not in sys.modules
    if not torch.cuda.is_available():
        assert resolve_impl("auto") == "local"
        with pytest.raises(RuntimeError, match=r"needs a CUDA GPU and the \[gpu\] extra"):
            resolve_impl("transformer_engine")


def test_cuda_redirect_is_scoped(mcore):
    from setdiff_mega.compat import mcore_cpu

    if torch.cuda.is_available():
        pytest.skip("CPU-only behaviour")
    with mcore_cpu.cuda_redirect():
        z = torch.zeros(2, device="cuda")            # an mcore-style literal works inside the scope
        assert z.device.type == "cpu" and z.type() == "torch.cuda.FloatTensor"
    assert torch.zeros(1).type() == "torch.FloatTensor"   # and nothing leaks outside it


@pytest.mark.parametrize("over", [dict(), dict(activation="swiglu", num_query_groups=2, add_bias_linear=True),
                                  dict(normalization="RMSNorm", ffn_hidden_size=48)])
def test_flop_count_uses_the_real_parameter_count(mcore, over):
    """The analytic body parameter count (the 6 * T * P term of the MFU) equals the built model's."""
    from setdiff_mega.config import ModelConfig
    from setdiff_mega.model import build_model
    from setdiff_mega.training.flops import body_parameters, flops_per_sample, peak_flops, processed_positions

    mc = ModelConfig(num_layers=3, hidden_size=32, num_attention_heads=4, **over)
    model = build_model(mc, 61)
    assert body_parameters(mc) == sum(p.numel() for p in model.decoder.layers.parameters())
    assert processed_positions("setdlm", 16) == (32, 16) and processed_positions("ar", 16) == (15, 15)
    f = flops_per_sample(mc, model.padded_vocab_size, "setdlm", 16)
    assert f == 6 * 32 * body_parameters(mc) + 6 * 16 * 32 * model.padded_vocab_size + 12 * 3 * 32 * 32 * 32
    assert peak_flops(100.0) == 1e14
    if not torch.cuda.is_available():
        assert peak_flops() is None


def test_bf16_autocast_training_step_on_cpu(mcore):
    """train.precision=bf16 on CPU: megatron-core's linear backward runs under the forward's CPU autocast
    (mcore_cpu shim, item 5); gradients land in the fp32 master weights."""
    from setdiff_mega.config import ModelConfig
    from setdiff_mega.model import build_model

    torch.manual_seed(0)
    model = build_model(ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, zero_init_head=False,
                                    make_vocab_size_divisible_by=8), 61)
    obj = SetDLMObjective(MASK_ID, D=4)
    inp = obj.build_inputs(_x(), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(**inp.model_kwargs())
    loss, _ = obj.loss(logits, inp)
    loss.backward()
    for p in model.parameters():
        assert p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32
        assert torch.isfinite(p.grad).all()
