"""Pipeline parallelism: PP = 2 through megatron-core's 1F1B schedule gives the PP = 1 losses and gradients.

Stages own different layers, so weights are set from a deterministic function of each parameter's
*global* name (stage s's local layer i is global layer s * layers_per_stage + i).
"""
import re
import zlib

import pytest
import torch

from .harness import run_ranks

L, B, V, MASK, LAYERS, MICRO = 10, 2, 61, 60, 4, 3


def _global_name(name, stage, per_stage):
    return re.sub(r"decoder\.layers\.(\d+)", lambda m: f"decoder.layers.{int(m.group(1)) + stage * per_stage}", name)


def _pipeline_run(rank, world, pp, objective_name):
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from setdiff_mega.compat import mcore_cpu
    from setdiff_mega.config import ModelConfig
    from setdiff_mega.diffusion import build_objective
    from setdiff_mega.model import build_model
    from setdiff_mega.parallel import initialize

    initialize(pipeline_model_parallel_size=pp, seed=1234)
    stage, per = ps.get_pipeline_model_parallel_rank(), LAYERS // pp
    mc = ModelConfig(num_layers=LAYERS, hidden_size=32, num_attention_heads=4, zero_init_head=False,
                     make_vocab_size_divisible_by=8)
    model = build_model(mc, V, pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage())
    names = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            g = _global_name(name, stage, per)
            names[name] = g
            gen = torch.Generator().manual_seed(zlib.crc32(g.encode()))
            base = 1.0 if (p.dim() == 1 and "norm" in g) else 0.0
            p.copy_(base + 0.1 * torch.randn(p.shape, generator=gen))
    obj = build_objective(objective_name, MASK, D=4, block_size=2)
    data = [obj.build_inputs(torch.randint(0, 58, (B, L), generator=torch.Generator().manual_seed(10 + m)),
                             generator=torch.Generator().manual_seed(20 + m)) for m in range(MICRO)]
    T = data[0].tokens.shape[1]

    def forward_step(data_iterator, model):
        inp = next(data_iterator)
        out = model(inp.tokens, inp.position_ids, inp.attention_mask, inp.logits_start)

        def loss_func(output):
            loss, _ = obj.loss(output, inp)
            return loss, {"loss": loss.detach()}
        return out, loss_func

    with mcore_cpu.cuda_redirect():
        losses = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(data), model=[model], num_microbatches=MICRO,
            seq_length=T, micro_batch_size=B, decoder_seq_length=T, forward_only=False)
    grads = {names[n]: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"losses": [x["loss"].item() for x in losses] if ps.is_pipeline_last_stage() else None, "grads": grads}


@pytest.mark.parametrize("objective_name", ["setdlm", "ar"])
def test_pp2_matches_pp1(objective_name):
    ref = run_ranks(_pipeline_run, world=1, args=(1, objective_name))[0]
    out = run_ranks(_pipeline_run, world=2, args=(2, objective_name))
    assert out[0]["losses"] is None and len(out[1]["losses"]) == MICRO      # losses live on the last stage
    assert out[1]["losses"] == pytest.approx(ref["losses"], rel=1e-5)
    merged = {**out[0]["grads"], **out[1]["grads"]}
    assert set(merged) == set(ref["grads"])                                  # every parameter on exactly one stage
    assert not set(out[0]["grads"]) & set(out[1]["grads"])
    for name, g in ref["grads"].items():
        torch.testing.assert_close(merged[name], g, rtol=1e-4, atol=1e-6, msg=name)
