"""FP8 without Transformer Engine: torchao float8 linears swapped in through the layer spec.

On CPU torchao emulates the float8 casts (same rounding, high-precision matmuls), so these tests check
the wiring and the numerics: the four linears of every layer run in float8, the checkpoint layout is the
bf16 model's, and the loss and gradients stay close to the high-precision model's (but not equal: the
casts really happen)."""
import pytest
import torch

from setdiff_mega.config import ConfigError, ModelConfig, RunConfig, validate
from setdiff_mega.diffusion.objectives import SetDLMObjective

pytest.importorskip("torchao")

MASK_ID = 60


def _pair(recipe):
    from setdiff_mega.model import build_model

    mods = []
    for fp8 in ("none", "torchao"):
        torch.manual_seed(0)
        mc = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                         zero_init_head=False, make_vocab_size_divisible_by=16, attention_backend="setcausal",
                         fp8=fp8, fp8_recipe=recipe)
        mods.append(build_model(mc, 61))
    mods[1].load_state_dict(mods[0].state_dict())      # same parameters, same names
    return mods


def _cos(a, b):
    return torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0).item()


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_linears_track_the_high_precision_model(mcore, recipe):
    from setdiff_mega.model.fp8 import float8_layers

    ref, f8 = _pair(recipe)
    assert len(float8_layers(f8)) == 4 * 2 and not float8_layers(ref)
    x = torch.randint(0, 59, (4, 16), generator=torch.Generator().manual_seed(1))
    obj = SetDLMObjective(MASK_ID, D=4)
    inp = obj.build_inputs(x, generator=torch.Generator().manual_seed(0))
    out = {}
    for name, model in (("ref", ref), ("f8", f8)):
        logits = model(**inp.model_kwargs())
        loss, _ = obj.loss(logits, inp)
        loss.backward()
        out[name] = (logits.detach(), loss.item(), {n: p.grad for n, p in model.named_parameters()})
    (lr, sr, gr), (lf, sf, gf) = out["ref"], out["f8"]
    rel = ((lf - lr).norm() / lr.norm()).item()
    assert 1e-4 < rel < 0.1, rel                  # float8 rounding happened, and stayed small
    assert abs(sf - sr) / sr < 0.02
    for n in gr:
        assert _cos(gf[n], gr[n]) > 0.99, n


def test_fp8_configuration_errors():
    def cfg(**model):
        c = RunConfig()
        for k, v in model.items():
            setattr(c.model, k, v)
        return c

    with pytest.raises(ConfigError, match="model.fp8=te needs Transformer Engine"):
        validate(cfg(fp8="te", transformer_impl="local"))
    with pytest.raises(ConfigError, match="delayed is Transformer Engine's"):
        validate(cfg(fp8="torchao", fp8_recipe="delayed"))
    c = cfg(fp8="torchao")
    c.parallel.tensor_model_parallel_size = 2
    with pytest.raises(ConfigError, match="tensor_model_parallel_size=1 only"):
        validate(c)


def test_fp8_te_without_transformer_engine_is_a_clear_error(mcore):
    from setdiff_mega.model import build_model

    with pytest.raises(RuntimeError, match="Transformer Engine"):
        build_model(ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, fp8="te"), 61)
