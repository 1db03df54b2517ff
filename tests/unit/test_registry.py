"""The method registry: adding an objective is one Objective class + one ``register`` call. A test-only
toy objective (AR with a reversed order: right-to-left factorisation) is registered here and then
validates, builds, trains, counts FLOPs, decodes-config and evaluates through the normal entry points."""
import dataclasses

import pytest
import torch

from setdiff_mega import methods
from setdiff_mega.diffusion.objectives import ARObjective, ModelInputs


class ReversedAR(ARObjective):
    """AR over the reversed sequence: positions L-1 .. 0 (a different factorisation, same mask)."""
    name = "toyrev"

    def build_inputs(self, tokens, context=None, padding=None, generator=None, training=True) -> ModelInputs:
        inp = super().build_inputs(tokens.flip(1), None if context is None else context.flip(1),
                                   None if padding is None else padding.flip(1), generator, training)
        return inp


@pytest.fixture
def toy():
    rec = methods.register(methods.Method(
        "toyrev", "ToyRev", ReversedAR, "setdiff_mega.decoding.baselines:ARSampler", "exact", causal=True,
        pattern="causal"))
    yield rec
    methods.unregister("toyrev")


def test_a_registered_objective_is_validated_built_and_counted(toy):
    from setdiff_mega.config import ConfigError, load_config
    from setdiff_mega.diffusion import build_objective
    from setdiff_mega.inference.options import generation_config
    from setdiff_mega.training.flops import processed_positions

    cfg = load_config(None, ["objective.name=toyrev", "data.seq_length=32"])
    assert isinstance(build_objective("toyrev", 3), ReversedAR)
    assert processed_positions("toyrev", 32) == (31, 31)
    assert generation_config(cfg.objective, 32).block_size == 32
    methods.unregister("toyrev")
    with pytest.raises(ConfigError, match="objective.name='toyrev' is not one of ar, mdlm, bd3lm, setdlm"):
        load_config(None, ["objective.name=toyrev"])


def test_a_registered_objective_trains_and_scores(toy, tmp_path, mcore):
    from setdiff_mega.config import load_config
    from setdiff_mega.data.prepare import prepare
    from setdiff_mega.eval.likelihood import sequence_nll
    from setdiff_mega.training import train

    data = tmp_path / "data"
    prepare(data, None, num_math=60, num_stories=60, vocab_size=300, heldout=4, log=lambda *a: None)
    cfg = load_config(None, ["objective.name=toyrev", "model.num_layers=1", "model.hidden_size=32",
                             "model.num_attention_heads=2", "data.seq_length=32", f"data.path={data}/corpus",
                             "train.train_steps=3", "train.micro_batch_size=2", "train.eval_iters=1",
                             "train.eval_interval=0", f"train.save_dir={tmp_path / 'run'}", "logging.wandb=disabled",
                             "logging.progress=false"])
    res = train(cfg, log=lambda *a: None)
    assert res.final_step == 3 and res.final_val_loss < res.initial_val_loss
    from setdiff_mega.checkpoint import load_model

    model, objective, tok, _ = load_model(tmp_path / "run")
    assert isinstance(objective, ReversedAR)
    r = sequence_nll(model, objective, torch.randint(4, tok.vocab_size, (1, 32)), samples=3)
    assert torch.isfinite(r["nll"]).all()


# -- the attention-backend registry: adding a backend is one core attention + one record --------------------

from setdiff_mega import backends  # noqa: E402
from setdiff_mega.model.attention import SDPACoreAttention  # noqa: E402

CALLS = []


class ToyCoreAttention(SDPACoreAttention):
    """SDPA that records the patterns it is given (a test-only backend)."""

    def attend(self, q, k, v, attention_mask, pattern):
        CALLS.append(None if pattern is None else pattern.kind)
        return super().attend(q, k, v, attention_mask, pattern)


@pytest.fixture
def toy_backend():
    rec = backends.register(backends.AttentionBackend(
        "toy", f"{__name__}:ToyCoreAttention", "test-only SDPA that records its patterns",
        native=lambda kind, block: kind == "causal", kv_cache=False, cpu_backward=False, benchmark=False))
    CALLS.clear()
    yield rec
    backends.unregister("toy")


def test_a_registered_backend_is_validated_built_estimated_and_its_capabilities_read(toy_backend, mcore):
    from benchmarks.training import default_settings
    from setdiff_mega.config import ConfigError, load_config
    from setdiff_mega.diffusion import build_objective
    from setdiff_mega.model import build_model
    from setdiff_mega.training.memory import activation_bytes

    cfg = load_config(None, ["model.attention_backend=toy", "model.num_layers=1", "model.hidden_size=32",
                             "model.num_attention_heads=2", "data.seq_length=16", "objective.name=ar"])
    model = build_model(cfg.model, 40).eval()
    assert all(isinstance(layer.self_attention.core_attention, ToyCoreAttention) for layer in model.decoder.layers)
    obj = build_objective("ar", 39)
    inp = obj.build_inputs(torch.randint(0, 39, (2, 16)))
    model(**inp.model_kwargs())
    assert CALLS == ["causal"]
    with pytest.raises(RuntimeError, match="model.attention_backend=toy has none"):   # its kv_cache capability
        with model.use_cache(object()):
            pass
    # its memory term: no mask rows under CP for the patterns it runs natively (causal), rows otherwise
    ar = activation_bytes(cfg.model, "ar", 16, 2, cp=2, padded_vocab=128)
    sdpa = activation_bytes(dataclasses.replace(cfg.model, attention_backend="sdpa"), "ar", 16, 2, cp=2,
                            padded_vocab=128)
    assert sdpa - ar == 8 * 16          # the rank's rows (15 positions padded to 16, over CP = 2) x 16 keys
    assert "toy" not in {b for _, _, b, _ in default_settings()}                     # benchmark=False
    if not torch.cuda.is_available():                                                # cpu_backward=False
        from setdiff_mega.training import train

        with pytest.raises(ConfigError, match="backend=toy has no backward on CPU.*one of sdpa, setcausal, local"):
            train(cfg)
    with pytest.raises(ConfigError, match="context_parallel_size=2 needs .*toy"):
        load_config(None, ["model.attention_backend=local", "parallel.context_parallel_size=2", "data.seq_length=16"])
    backends.unregister("toy")
    with pytest.raises(ConfigError, match="model.attention_backend='toy' is not one of sdpa, flex, setcausal, local"):
        load_config(None, ["model.attention_backend=toy"])
