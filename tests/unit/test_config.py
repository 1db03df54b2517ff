"""Config loading, overrides and the one-message validation errors."""
from pathlib import Path

import pytest

from setdiff_mega.config import ConfigError, RunConfig, load_config, parse_overrides

ROOT = Path(__file__).resolve().parents[2]


def test_presets_load_and_validate():
    tiny = load_config(ROOT / "configs/tiny_cpu.yaml")
    assert tiny.objective.name == "setdlm" and tiny.data.seq_length == 128
    owt = load_config(ROOT / "configs/owt_setdlm.yaml")
    assert (owt.model.num_layers, owt.model.hidden_size, owt.model.num_attention_heads) == (12, 768, 12)
    assert owt.data.seq_length == 1024 and owt.objective.D == 8
    assert owt.train.lr == 3e-4 and owt.train.warmup_steps == 2500 and owt.train.lr_schedule == "constant"
    assert owt.train.micro_batch_size * owt.train.grad_accum_steps == 512


def test_dotted_overrides_are_typed():
    cfg = load_config(ROOT / "configs/tiny_cpu.yaml", ["train.lr=3e-4", "objective.name=ar",
                                                         "objective.S_max=null", "logging.progress=false"])
    assert cfg.train.lr == 3e-4 and isinstance(cfg.train.lr, float)
    assert cfg.objective.name == "ar" and cfg.objective.S_max is None and cfg.logging.progress is False
    assert parse_overrides(["a.b.c=1"]) == {"a": {"b": {"c": 1}}}


@pytest.mark.parametrize("overrides,pattern", [
    (["objective.name=gpt"], r"objective.name='gpt' is not one of ar, mdlm, bd3lm, setdlm"),
    (["objective.D=8", "objective.S_max=4"], r"objective.D=8 exceeds objective.S_max=4; set S_max >= D"),
    (["objective.D=4", "objective.S_max=256"], r"objective.S_max=256 exceeds data.seq_length L=128; set S_max <= L"),
    (["model.hiden_size=64"], r"unknown config field 'model.hiden_size'; did you mean 'model.hidden_size'\?"),
    (["train.lr=fast"], r"train.lr: expected float, got 'fast'"),
    (["model.num_attention_heads=7"], r"model.hidden_size=160 is not divisible by model.num_attention_heads=7"),
    (["objective.name=bd3lm", "objective.block_size=5"], r"objective.block_size=5 must be >= 1 and divide"),
    (["train.lr_schedule=exp"], r"train.lr_schedule='exp' is not one of"),
    (["trainlr"], r"override 'trainlr' must look like section.field=value"),
])
def test_config_errors_name_the_field(overrides, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config(ROOT / "configs/tiny_cpu.yaml", overrides)


def test_s_max_above_l_with_d_default():
    # D = 80 gives S_max = 160 > L = 128 (D itself is fine)
    with pytest.raises(ConfigError, match=r"objective.S_max=160 exceeds data.seq_length L=128"):
        load_config(None, ["objective.D=80"])


def test_missing_config_file():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("configs/nope.yaml")


def test_defaults_are_valid():
    assert isinstance(load_config(None), RunConfig)


@pytest.mark.parametrize("overrides,pattern", [
    (["parallel.tensor_model_parallel_size=3", "model.num_attention_heads=5"],
     r"TP=3 does not divide model.num_attention_heads=5"),
    (["parallel.tensor_model_parallel_size=2", "model.num_attention_heads=4", "model.num_query_groups=1"],
     r"TP=2 does not divide the 1 KV groups"),
    (["parallel.pipeline_model_parallel_size=8"], r"PP=8 is larger than model.num_layers=4"),
    (["parallel.pipeline_model_parallel_size=3"], r"PP=3 does not divide model.num_layers=4"),
    (["parallel.virtual_pipeline_model_parallel_size=2"], r"virtual_pipeline_model_parallel_size=2 needs V >= 2 "
                                                           r"and PP >= 2 \(PP=1\)"),
    (["parallel.pipeline_model_parallel_size=2", "parallel.virtual_pipeline_model_parallel_size=4"],
     r"PP=2 x V=4 = 8 model chunks do not divide model.num_layers=4"),
    (["parallel.pipeline_model_parallel_size=2", "parallel.virtual_pipeline_model_parallel_size=2",
      "train.grad_accum_steps=3"], r"train.grad_accum_steps=3 must be a multiple of 2"),
    (["train.keep_last=-1"], r"train.keep_last=-1 and train.save_interval=0 must be >= 0"),
])
def test_impossible_layouts_fail_with_the_sizes(overrides, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config(ROOT / "configs/tiny_cpu.yaml", overrides)


def test_world_size_must_be_a_multiple_of_tp_cp_pp():
    from setdiff_mega.config import validate_layout

    cfg = load_config(ROOT / "configs/tiny_cpu.yaml", ["parallel.pipeline_model_parallel_size=2"])
    validate_layout(cfg, world_size=4)
    with pytest.raises(ConfigError, match=r"world size 3 is not divisible by TP\*CP\*PP = 1\*1\*2 = 2"):
        validate_layout(cfg, world_size=3)


@pytest.mark.parametrize("overrides,pattern", [
    (["parallel.sequence_parallel=true"], r"sequence_parallel needs TP > 1"),
    (["parallel.sequence_parallel=true", "parallel.tensor_model_parallel_size=5", "objective.name=ar"],
     r"splits the 127 processed positions \(objective ar, L=128\) over TP=5"),
    (["parallel.sequence_parallel=true", "parallel.tensor_model_parallel_size=5", "train.zero_stage=1"],
     r"not supported with DeepSpeed ZeRO"),
    (["parallel.pipeline_model_parallel_size=2", "train.zero_stage=3"],
     r"ZeRO \(train.zero_stage=3\) is not supported together with PP=2"),
    (["train.async_save=true", "train.zero_stage=2"], r"use train.async_save=false"),
    (["model.recompute_granularity=full", "model.recompute_method=block", "model.recompute_num_layers=3",
      "parallel.pipeline_model_parallel_size=2"], r"each model chunk, which has 2: choose at most 2"),
    (["data.packing=true"], r"data.packing packs supervised conversations \(data.format=sft\)"),
    (["data.packing=true", "data.format=sft", "parallel.context_parallel_size=2"],
     r"parallel.context_parallel_size=2 cuts into chunks over ranks: use data.packing=false"),
])
def test_parallel_feature_conflicts(overrides, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config(ROOT / "configs/tiny_cpu.yaml", overrides)


def test_packing_needs_a_core_attention_that_keeps_documents_apart():
    from setdiff_mega import backends

    backends.register(backends.AttentionBackend("blind", backends.SDPA.core, "ignores documents",
                                                packed_documents=False))
    try:
        load_config(ROOT / "configs/tiny_cpu.yaml", ["model.attention_backend=blind"])
        with pytest.raises(ConfigError, match=r"data.packing needs a core attention .*\(model.attention_backend=sdpa, "
                                              r"flex, setcausal, local\); model.attention_backend=blind does not"):
            load_config(ROOT / "configs/tiny_cpu.yaml", ["model.attention_backend=blind", "data.packing=true",
                                                         "data.format=sft"])
    finally:
        backends.unregister("blind")


def test_a_yaml_file_that_sets_a_key_twice_is_refused_with_both_lines(tmp_path):
    """PyYAML keeps the last value silently; the config loader and the sweep grid refuse it (issue 42)."""
    from setdiff_mega.config import load_config
    from setdiff_mega.config.sections import ConfigError
    from setdiff_mega.eval.sweep.grid import SweepError, load_grid

    f = tmp_path / "run.yaml"
    f.write_text("train:\n  lr: 1.0e-3\n  steps: 10\n  lr: 3.0e-3\nmodel:\n  num_layers: 2\n")
    with pytest.raises(ConfigError, match=r"sets 'train.lr' twice \(lines 2 and 4\)") as e:
        load_config(f)
    assert str(f) in str(e.value) and "\n" not in str(e.value)
    f.write_text("train:\n  lr: 1.0e-3\ntrain:\n  steps: 10\n")
    with pytest.raises(ConfigError, match=r"sets 'train' twice \(lines 1 and 3\)"):
        load_config(f)
    g = tmp_path / "grid.yaml"
    g.write_text("name: x\nmodels:\n  - {num_layers: 2, num_layers: 4}\n")
    with pytest.raises(SweepError, match=r"sets 'models\[0\].num_layers' twice \(lines 3 and 3\)"):
        load_grid(g)


def test_every_shipped_yaml_has_each_key_once():
    from pathlib import Path

    from setdiff_mega.config.yamlfile import read_yaml

    files = sorted((Path(__file__).resolve().parents[2] / "configs").rglob("*.yaml"))
    assert files
    for f in files:
        read_yaml(f)
