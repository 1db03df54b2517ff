"""The per-rank memory estimate (setdiff_mega/training/memory.py, tools/estimate_memory.py) against what the
model holds: its parameter count exactly, the activations autograd keeps for the backward (measured with
saved-tensor hooks, parameters excluded) and the peak of the bytes allocated during a training step
(activations + gradients, measured from the profiler's allocation events) within 25%, with and without
recomputation; CP and TP shrink the per-rank activations."""
import pytest
import torch

from setdiff_mega.diffusion.objectives import build_inputs_per_sample, build_objective
from setdiff_mega.training.memory import activation_bytes, estimate, rank_parameters


def _measure(mc, objective, L, b):
    from setdiff_mega.model import build_model

    torch.manual_seed(0)
    model = build_model(mc, 301)
    model.train()
    obj = build_objective(objective, 300, D=2, block_size=4)
    x = torch.randint(0, 300, (b, L), generator=torch.Generator().manual_seed(1))
    inp = build_inputs_per_sample(obj, x, list(range(b)), seed=5)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, _ = obj.loss(model(**inp.model_kwargs()), inp)
    loss.backward()
    return model, sum(seen.values())


@pytest.mark.parametrize("objective,fields,L,b", [
    ("setdlm", {}, 64, 4),
    ("bd3lm", {"hidden_size": 96, "num_attention_heads": 4}, 32, 8),
    ("ar", {"activation": "swiglu"}, 64, 4),
    ("setdlm", {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}, 64, 4),
    ("setdlm", {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 2}, 64, 4),
])
def test_estimate_matches_the_model(mcore, objective, fields, L, b):
    from setdiff_mega.config import ModelConfig

    mc = ModelConfig(**{"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "zero_init_head": False,
                        **fields})
    model, saved = _measure(mc, objective, L, b)
    assert rank_parameters(mc, model.padded_vocab_size, 1, 1) == sum(p.numel() for p in model.parameters())
    kept, workspace = activation_bytes(mc, objective, L, b, padded_vocab=model.padded_vocab_size, split=True)
    assert kept == pytest.approx(saved, rel=0.25), (kept, saved)
    assert workspace >= 3 * 4 * model.padded_vocab_size * b * (L if objective != "ar" else L - 1)   # loss backward


@pytest.mark.parametrize("objective,fields,L,b", [
    ("setdlm", {}, 128, 8),
    ("setdlm", {"hidden_size": 32, "num_attention_heads": 2, "num_layers": 2}, 64, 16),   # the head dominates
    ("bd3lm", {"hidden_size": 96, "num_attention_heads": 4}, 32, 8),
    ("ar", {"activation": "swiglu"}, 64, 4),
    ("setdlm", {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}, 64, 4),
    ("setdlm", {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 2}, 64, 4),
])
def test_estimate_matches_the_measured_peak_of_a_training_step(mcore, objective, fields, L, b):
    """Activations + gradients of the estimate against the measured peak of the bytes allocated during one
    training step (forward, backward, AdamW; measure_step_peak), within 25%."""
    from setdiff_mega.config import ModelConfig
    from setdiff_mega.model import build_model
    from setdiff_mega.training.memory import measure_step_peak

    mc = ModelConfig(**{"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "zero_init_head": False,
                        **fields})
    torch.manual_seed(0)
    model = build_model(mc, 301).train()
    opt = torch.optim.AdamW(model.parameters())
    obj = build_objective(objective, 300, D=2, block_size=4)
    inp = build_inputs_per_sample(obj, torch.randint(0, 300, (b, L), generator=torch.Generator().manual_seed(1)),
                                  list(range(b)), seed=5)

    def step():
        loss, _ = obj.loss(model(**inp.model_kwargs()), inp)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    step()                                       # the optimizer state exists before the measured step
    peak = measure_step_peak(step)
    grads = 4 * sum(p.numel() for p in model.parameters())
    est = activation_bytes(mc, objective, L, b, padded_vocab=model.padded_vocab_size) + grads
    assert est == pytest.approx(peak, rel=0.25), (est, peak)


def test_context_and_tensor_parallel_shrink_the_activations_per_rank():
    from setdiff_mega.config import load_config

    cfg = load_config(None, ["data.seq_length=16384", "model.num_layers=24", "model.hidden_size=2048",
                             "model.num_attention_heads=16", "train.micro_batch_size=1",
                             "parallel.context_parallel_size=4", "parallel.tensor_model_parallel_size=2"])
    one = estimate(load_config(None, ["data.seq_length=16384", "model.num_layers=24", "model.hidden_size=2048",
                                      "model.num_attention_heads=16", "train.micro_batch_size=1"]), 50304)
    sharded = estimate(cfg, 50304, world_size=8)
    assert sharded.parameters < 0.55 * one.parameters
    assert sharded.activations < 0.2 * one.activations           # CP 4 x TP 2 (the dense mask shrinks by 4 only)
    full = estimate(load_config(None, ["data.seq_length=16384", "model.num_layers=24", "model.hidden_size=2048",
                                       "model.num_attention_heads=16", "train.micro_batch_size=1",
                                       "model.recompute_granularity=full", "model.recompute_method=uniform",
                                       "model.recompute_num_layers=1"]), 50304)
    assert full.activations < 0.3 * full.activations_no_recompute
