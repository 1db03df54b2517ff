"""Activation recomputation through megatron-core's own options (``model.recompute_granularity``,
``recompute_method``, ``recompute_num_layers``): the same loss and parameter gradients as without it, for the
dense-mask and the set-causal core attention, and fewer activations saved for the backward (measured by
the bytes the autograd graph holds after the forward)."""
import pytest
import torch

from setdiff_mega.diffusion.objectives import SetDLMObjective, build_inputs_per_sample

MASK_ID, L = 60, 16


def _model(backend, **recompute):
    from setdiff_mega.config import ModelConfig
    from setdiff_mega.model import build_model

    torch.manual_seed(0)
    mc = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, zero_init_head=False,
                     make_vocab_size_divisible_by=8, attention_backend=backend, **recompute)
    return build_model(mc, 61)


def saved_activation_bytes(fn):
    """(fn(), bytes of the distinct tensors autograd saved for the backward while fn ran)."""
    seen = {}

    def pack(t):
        seen[(t.untyped_storage().data_ptr(), t.device)] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def _step(model, obj, inp):
    model.zero_grad(set_to_none=True)
    loss, saved = saved_activation_bytes(lambda: obj.loss(model(**inp.model_kwargs()), inp)[0])
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}, saved


@pytest.mark.parametrize("backend", ["sdpa", "setcausal"])
@pytest.mark.parametrize("recompute", [
    {"recompute_granularity": "selective"},
    {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
    {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 2},
])
def test_recomputation_keeps_loss_and_gradients_and_saves_memory(mcore, backend, recompute):
    obj = SetDLMObjective(MASK_ID, D=2)
    x = torch.randint(0, 59, (4, L), generator=torch.Generator().manual_seed(1))
    inp = build_inputs_per_sample(obj, x, list(range(4)), seed=5)
    ref_model, model = _model(backend), _model(backend, **recompute)
    model.load_state_dict(ref_model.state_dict())
    model.train()
    ref_model.train()
    loss0, grads0, saved0 = _step(ref_model, obj, inp)
    loss1, grads1, saved1 = _step(model, obj, inp)
    assert loss1 == pytest.approx(loss0, rel=1e-6)
    for k, g in grads0.items():
        torch.testing.assert_close(grads1[k], g, rtol=1e-5, atol=1e-7, msg=k)
    assert saved1 < saved0                      # what recomputation is for


@pytest.mark.parametrize("fields,message", [
    ({"recompute_granularity": "some"}, "model.recompute_granularity"),
    ({"recompute_granularity": "full"}, "recompute_method"),
    ({"recompute_granularity": "full", "recompute_method": "uniform"}, "recompute_num_layers"),
    ({"recompute_granularity": "selective", "recompute_num_layers": 2}, "selective"),
    ({"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 5}, "num_layers=4"),
])
def test_bad_recompute_settings_are_refused(fields, message):
    from setdiff_mega.config import ConfigError, ModelConfig

    with pytest.raises(ConfigError, match=message):
        ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, **fields).check()
