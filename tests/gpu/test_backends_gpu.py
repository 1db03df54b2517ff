"""GPU checks of the attention backends and FP8 (marker ``gpu``; excluded from the default CPU suite).

Run by ``scripts/gpu_check.sh`` on a CUDA machine: ``pytest -m gpu tests/gpu``. In bf16 every backend
(the fused-kernel set-causal decomposition, compiled FlexAttention, dense-mask SDPA) is compared with an
fp32 dense-mask reference computed from the same bf16 inputs; each must be as close to it as bf16 SDPA
with the dense mask is (within 2x, plus a small floor), in outputs and gradients, and inside the model.
"""
import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

MASK_ID = 60


def _err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("L,d", [(16, 64), (100, 64), (256, 64), (1024, 128)])
def test_backends_agree_in_bf16(L, d):
    from setdiff_mega.diffusion.masks import MaskPattern
    from setdiff_mega.model.flex import flex_attention
    from setdiff_mega.model.setcausal import SetCausalAttention, kernel_supported, setcausal_attention

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 4, 2 * L, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    assert kernel_supported(q)
    dout = torch.randn_like(q)
    pattern = MaskPattern("two_stream", 2 * L)
    keep = pattern.dense("cuda")[:, None]

    def run(fn, dtype):
        x = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        out = fn(*x)
        out.backward(dout.to(dtype))
        return [out.detach()] + [t.grad for t in x]

    ref = run(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, attn_mask=keep), torch.float32)
    dense = run(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, attn_mask=keep), torch.bfloat16)
    calls = []
    orig = SetCausalAttention.apply
    SetCausalAttention.apply = lambda *a: calls.append(1) or orig(*a)
    try:
        got = {"setcausal": run(setcausal_attention, torch.bfloat16)}
    finally:
        SetCausalAttention.apply = orig
    assert calls, "the fused-kernel path was not taken"
    got["flex"] = run(lambda a, b, c: flex_attention(a, b, c, pattern), torch.bfloat16)
    for name, res in got.items():
        for i, what in enumerate(("out", "dq", "dk", "dv")):
            assert _err(res[i], ref[i]) <= 2 * _err(dense[i], ref[i]) + 2e-3, (name, what)
    # the self-only row (noisy rank 0) is v exactly
    assert torch.equal(got["setcausal"][0][:, :, L], v[:, :, L])


def _model(backend, fp8="none"):
    from setdiff_mega.config import ModelConfig
    from setdiff_mega.model import build_model

    torch.manual_seed(0)
    mc = ModelConfig(num_layers=2, hidden_size=256, num_attention_heads=4, num_query_groups=2, zero_init_head=False,
                     make_vocab_size_divisible_by=64, attention_backend=backend, transformer_impl="local", fp8=fp8)
    return build_model(mc, 61).cuda()


def test_model_backends_agree_in_bf16(mcore):
    from setdiff_mega.diffusion import SetDLMObjective

    x = torch.randint(0, 59, (4, 128), device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    padding = torch.zeros_like(x, dtype=torch.bool)
    padding[1, -20:] = True
    context = torch.zeros_like(padding)
    context[0, :16] = True
    obj = SetDLMObjective(MASK_ID, D=4)
    inp = obj.build_inputs(x, context=context, padding=padding, generator=torch.Generator(device="cuda").manual_seed(0))
    rows = inp.attention_pattern.key_valid[:, 128:]
    res = {}
    mods = {b: _model(b) for b in ("sdpa", "setcausal", "flex")}
    for m in mods.values():
        m.load_state_dict(mods["sdpa"].state_dict())
    for name, model in mods.items():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(**inp.model_kwargs())
        loss, _ = obj.loss(logits, inp)
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters()])
        res[name] = (logits.float()[rows].detach(), loss.item(), grads)
    ref = res["sdpa"]
    for name in ("setcausal", "flex"):
        logits, loss, grads = res[name]
        assert _err(logits, ref[0]) < 2e-2, name
        assert abs(loss - ref[1]) / ref[1] < 1e-2, name
        assert F.cosine_similarity(grads, ref[2], dim=0) > 0.99, name


def test_torchao_fp8_trains_close_to_bf16(mcore):
    pytest.importorskip("torchao")
    from setdiff_mega.diffusion import SetDLMObjective
    from setdiff_mega.model.fp8 import float8_layers, hardware_fp8

    if not hardware_fp8():
        pytest.skip("FP8 tensor cores need compute capability >= 8.9")
    x = torch.randint(0, 59, (8, 128), device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    obj = SetDLMObjective(MASK_ID, D=4)
    losses = {}
    for fp8 in ("none", "torchao"):
        model = _model("setcausal", fp8)
        assert bool(float8_layers(model)) == (fp8 == "torchao")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        gen = torch.Generator(device="cuda").manual_seed(0)
        for _ in range(20):
            inp = obj.build_inputs(x, generator=gen)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss, _ = obj.loss(model(**inp.model_kwargs()), inp)
            loss.backward()
            opt.step()
            opt.zero_grad()
        losses[fp8] = loss.item()
    assert abs(losses["torchao"] - losses["none"]) / losses["none"] < 0.05, losses
