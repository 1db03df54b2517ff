"""Tensor parallelism: TP = 2 over two gloo ranks gives the TP = 1 logits, loss and gradients (fp32)."""
import pytest
import torch

from .harness import run_ranks

L, B, V, MASK = 12, 3, 61, 60


def _forward_backward(rank, world, tp, objective_name, backend="sdpa", features=None):
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    from setdiff_mega.config import ModelConfig
    from setdiff_mega.diffusion import build_objective
    from setdiff_mega.model import build_model
    from setdiff_mega.parallel import initialize
    from setdiff_mega.training.step import allreduce_tp_partial_grads

    initialize(tensor_model_parallel_size=tp, seed=1234)
    torch.manual_seed(0)
    mc = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, zero_init_head=False,
                     make_vocab_size_divisible_by=8, activation="swiglu", attention_backend=backend,
                     **(features or {}))
    model = build_model(mc, V)
    x = torch.randint(0, 58, (B, L), generator=torch.Generator().manual_seed(1))
    pad = torch.zeros(B, L, dtype=torch.bool)
    pad[0, -2:] = True
    obj = build_objective(objective_name, MASK, D=4, block_size=3)
    inp = obj.build_inputs(x, padding=pad, generator=torch.Generator().manual_seed(2))
    logits = model(**inp.model_kwargs())
    loss, _ = obj.loss(logits, inp)
    loss.backward()
    allreduce_tp_partial_grads(model)                   # as the trainer does: q / k norms see this rank's heads
    qkv = model.decoder.layers[0].self_attention.linear_qkv.weight          # column-parallel: [out / tp, in]
    fc2 = model.decoder.layers[1].mlp.linear_fc2.weight                      # row-parallel: [out, in / tp]
    g_qkv = gather_from_tensor_model_parallel_region(qkv.grad.t().contiguous()).t() if tp > 1 else qkv.grad
    g_fc2 = gather_from_tensor_model_parallel_region(fc2.grad) if tp > 1 else fc2.grad
    norm = model.decoder.final_layernorm.weight.grad
    qk_norm = getattr(model.decoder.layers[0].self_attention, "q_layernorm", None)
    return {"g_qk_norm": qk_norm.weight.grad.detach() if hasattr(qk_norm, "weight") else None,
            "tp_rank": ps.get_tensor_model_parallel_rank(), "logits": logits.detach(), "loss": loss.item(),
            "g_qkv": g_qkv.detach(), "g_fc2": g_fc2.detach(), "g_norm": norm.detach(),
            "qkv_shape": tuple(qkv.shape), "rows": inp.attention_pattern.key_valid[:, inp.logits_start:]}


@pytest.mark.parametrize("objective_name", ["setdlm", "bd3lm", "ar"])
def test_tp2_matches_tp1(objective_name):
    ref = run_ranks(_forward_backward, world=1, args=(1, objective_name))[0]
    out = run_ranks(_forward_backward, world=2, args=(2, objective_name))
    assert out[0]["qkv_shape"][0] * 2 == ref["qkv_shape"][0]             # the weights really are sharded
    for r in (0, 1):
        o = out[r]
        assert o["loss"] == pytest.approx(ref["loss"], rel=1e-5)
        torch.testing.assert_close(o["logits"], ref["logits"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(o["g_qkv"], ref["g_qkv"], rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(o["g_fc2"], ref["g_fc2"], rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(o["g_norm"], ref["g_norm"], rtol=1e-4, atol=1e-6)


def test_tp2_matches_tp1_with_the_qwen_features():
    """Head size != hidden / heads, q / k norms (their gradients summed over the TP group: each rank holds
    half the heads), q / k / v bias, RMSNorm: TP = 2 gives the TP = 1 logits and gradients."""
    qwen = dict(kv_channels=24, qk_layernorm=True, add_qkv_bias=True, normalization="RMSNorm", norm_eps=1e-6)
    ref = run_ranks(_forward_backward, world=1, args=(1, "setdlm", "sdpa", qwen))[0]
    out = run_ranks(_forward_backward, world=2, args=(2, "setdlm", "sdpa", qwen))
    assert out[0]["qkv_shape"][0] * 2 == ref["qkv_shape"][0] == (4 + 2 * 2) * 24
    for o in out.values():
        torch.testing.assert_close(o["logits"], ref["logits"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(o["g_qkv"], ref["g_qkv"], rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(o["g_qk_norm"], ref["g_qk_norm"], rtol=1e-4, atol=1e-6)


def test_tp2_setcausal_backend_matches_tp1_dense_reference():
    """The mask-free set-causal attention on TP shards (2 of 4 heads, 1 of 2 KV groups per rank) gives the
    single-process dense-mask logits (real rows), loss and gradients."""
    ref = run_ranks(_forward_backward, world=1, args=(1, "setdlm", "sdpa"))[0]
    out = run_ranks(_forward_backward, world=2, args=(2, "setdlm", "setcausal"))
    rows = ref["rows"]
    assert not rows.all()                                                  # the batch has padding
    for r in (0, 1):
        o = out[r]
        assert o["loss"] == pytest.approx(ref["loss"], rel=1e-5)
        torch.testing.assert_close(o["logits"][rows], ref["logits"][rows], rtol=1e-5, atol=1e-5)
        for k in ("g_qkv", "g_fc2", "g_norm"):
            torch.testing.assert_close(o[k], ref[k], rtol=1e-4, atol=1e-6)


def _mask_row_logits(rank, world, tp, tie):
    from setdiff_mega.config import ModelConfig
    from setdiff_mega.model import build_model
    from setdiff_mega.model.token_rows import mean_token_rows
    from setdiff_mega.parallel import initialize

    initialize(tensor_model_parallel_size=tp, seed=1234)
    torch.manual_seed(0)
    mc = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, zero_init_head=False, head_bias=not tie,
                     make_vocab_size_divisible_by=8, tie_embeddings=tie)
    model = build_model(mc, V)
    mean_token_rows([model], [MASK], V - 1)                 # MASK = 60 = the last of the tokenizer's 61 tokens
    x = torch.randint(0, 58, (1, L), generator=torch.Generator().manual_seed(1))
    x[0, 3] = MASK
    with torch.no_grad():
        return model(x, torch.arange(L)[None], torch.ones(1, L, L, dtype=torch.bool).tril()[None], 0)


@pytest.mark.parametrize("tie", [True, False])
def test_tp2_mask_row_mean_matches_tp1(tie):
    """train.init_mask_row=mean: MASK's embedding / head row (and head bias) := the other tokens' mean, over TP
    shards as in one process (the MASK input then embeds as that mean; its logit is the mean logit)."""
    ref = run_ranks(_mask_row_logits, world=1, args=(1, tie))[0]
    for o in run_ranks(_mask_row_logits, world=2, args=(2, tie)).values():
        torch.testing.assert_close(o, ref, rtol=1e-5, atol=1e-5)
