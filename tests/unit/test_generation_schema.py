"""GenerationConfig's field metadata is the one schema of the generation options (decoding/schema.py): the CLI
flags, the server's request fields, the export's options and docs/guide/decoding.md's table are generated from it,
and a request is validated once."""
import argparse
from pathlib import Path
from unittest import mock

import pytest

from setdiff_mega.config.objective import ObjectiveConfig
from setdiff_mega.decoding import schema
from setdiff_mega.decoding.base import Canvas, GenerationConfig
from setdiff_mega.decoding.config import BOUNDS, OPTIONS, REGENERATE
from setdiff_mega.decoding.setdlm import SetDLMSampler
from setdiff_mega.errors import RequestError
from setdiff_mega.inference.options import FLAGS, add_generation_arguments, config_from_args
from setdiff_mega.serving.protocol import DIFFUSION, SERVED, SHARED, ServerDefaults, config_of, parse

from ..inference.mock import ScriptedModel, peaked
from ..serving_helpers import BOS, EOS, MASK, PAD, Tok

ROOT = Path(__file__).resolve().parents[2]


def test_the_options_table_of_the_guide_is_generated_from_the_schema():
    page = (ROOT / schema.GUIDE).read_text()
    assert page == schema.with_table(page, GenerationConfig), \
        f"{schema.GUIDE}'s options table is stale (an option changed); regenerate it: {REGENERATE}"
    table = page[page.index(schema.BEGIN):page.index(schema.END)]
    assert all(f"| `{name}` (" in table for name in OPTIONS)
    with pytest.raises(ValueError, match="markers"):
        schema.with_table("# no markers\n", GenerationConfig)


def test_every_field_has_its_schema_and_the_bounds_table_is_derived():
    assert set(OPTIONS) == set(GenerationConfig.__dataclass_fields__)
    for name, o in OPTIONS.items():
        assert o.help and "\n" not in o.help, name
        assert (o.kind in ("int", "float")) == (name in BOUNDS), name
    assert BOUNDS["context_length"] == ((int, None), 2, 1 << 20) and BOUNDS["tau"] == (float, 0.0, 1e308)
    with pytest.raises(ValueError, match="kind"):
        schema.Option("complex", "x")


def _args(*argv):
    p = argparse.ArgumentParser()
    add_generation_arguments(p)
    return p.parse_args(list(argv))


def test_cli_flags_are_generated_with_their_names_and_polarity():
    p = argparse.ArgumentParser()
    add_generation_arguments(p)
    flags = {s for a in p._actions for s in a.option_strings}
    assert {o.cli for o in FLAGS.values()} <= flags
    for name in ("--no-cache", "--no-eos-stop", "--prefix-only-infill", "--fht-cache-order", "--static-shapes",
                 "--speculative", "--stop", "--length-penalty", "--tau", "--window", "--commit-rule", "--seed"):
        assert name in flags
    o = ObjectiveConfig(name="setdlm", D=4)
    cfg = config_from_args(_args("--no-cache", "--no-eos-stop", "--prefix-only-infill", "--stop", "a", "--stop",
                                 "b", "--length-penalty", "80,1.1", "--tau", "0.5", "--stop-confidence", "0.1"),
                           o, 64)
    assert (cfg.use_cache, cfg.stop_at_eos, cfg.infill_full_context, cfg.stop_strings, cfg.length_penalty,
            cfg.tau, cfg.stop_confidence, cfg.window, cfg.context_length) == \
        (False, False, False, ("a", "b"), (80, 1.1), 0.5, 0.1, 4, 64)
    plain = config_from_args(_args(), o, 64)
    assert (plain.use_cache, plain.stop_at_eos, plain.fht_cache_order, plain.stop_strings) == (True, True, False, ())
    with pytest.raises(ValueError, match="tau=-1.0 must be in"):
        config_from_args(_args("--tau", "-1"), o, 64)
    with pytest.raises(ValueError, match="length_penalty='80': expected START,FACTOR"):
        config_from_args(_args("--length-penalty", "80"), o, 64)


def test_server_fields_are_generated_and_typed_by_the_schema():
    assert set(SERVED) == set(DIFFUSION) | {"temperature", "top_p", "seed"} and not set(DIFFUSION) & SHARED
    assert not {"max_new_tokens", "use_cache", "record", "stop_strings", "context_length"} & set(SERVED)
    d = ServerDefaults(objective=ObjectiveConfig(name="setdlm", D=4), seq_length=64, base=GenerationConfig())
    cfg = config_of({"tau": 1, "length_penalty": [80, 1.1], "stop_confidence": None, "stop_at_eos": None,
                     "window": 8}, d)
    assert (cfg.tau, cfg.length_penalty, cfg.stop_at_eos, cfg.window) == (1.0, (80, 1.1), True, 8)
    for body, why in [({"window": "8"}, "'window' must be an integer"), ({"stop_at_eos": 1}, "must be a bool"),
                      ({"length_penalty": [1]}, r"\[start, factor\]"), ({"tau": -1.0}, r"tau=-1.0 must be in"),
                      ({"commit_rule": "x"}, "commit_rule='x' must be one of auto")]:
        with pytest.raises(RequestError, match=why) as e:
            config_of(body, d)
        assert "\n" not in str(e.value)


class _Tok(Tok):
    vocab_size = 64


def _counting():
    """GenerationConfig's checks, counted (the real ones run)."""
    real = GenerationConfig._check
    calls = []

    def counted(self):
        calls.append(self)
        return real(self)
    return calls, mock.patch.object(GenerationConfig, "_check", counted)


def _decode(cfg):
    model = ScriptedModel(peaked([[(5, 3.0)]] * 40, 64))
    sampler = SetDLMSampler(model, MASK, PAD, EOS, cfg, tokenizer=_Tok())
    return sampler.generate(Canvas.from_prompts([[BOS, 3]], MASK, PAD, cfg.max_new_tokens))


@pytest.mark.parametrize("body", [{"prompt": [BOS, 3], "max_tokens": 4},
                                  {"prompt": [BOS, 3], "max_tokens": 4, "preset": "cnndm", "trace": True}])
def test_a_server_request_is_validated_once(body):
    d = ServerDefaults(objective=ObjectiveConfig(name="setdlm", D=4), seq_length=64, base=GenerationConfig())
    calls, patch = _counting()
    with patch:
        parsed = parse(body, "completions", _Tok(), d)
        out = _decode(parsed.config)
    assert len(calls) == 1 and len(out.tokens[0]) == 4
    assert parsed.config.record == bool(body.get("trace"))


def test_a_command_line_config_is_validated_once_and_a_changed_one_again():
    calls, patch = _counting()
    with patch:
        cfg = config_from_args(_args("--max-new-tokens", "4", "--tau", "0.5"), ObjectiveConfig(name="setdlm", D=4),
                               64)
        _decode(cfg)
        assert len(calls) == 1
        cfg.tau = -1.0                                     # changed after its check: checked (and refused) again
        with pytest.raises(ValueError, match="tau"):
            _decode(cfg)
    assert len(calls) == 2


def test_export_options_are_generated_from_the_schema():
    from setdiff_mega.hfmodel import generation_setdlm as g

    model = mock.Mock(decode_defaults={"window": 4, "do_sample": False}, spec=["decode_defaults", "config"])
    calls, patch = _counting()
    with patch:
        cfg = g.options(model, {"stop_strings": "END", "length_penalty": [8, 1.5], "do_sample": True,
                                "pad_token_id": 0})
    assert (cfg.stop_strings, cfg.length_penalty, cfg.temperature, cfg.window) == (("END",), (8, 1.5), 1.0, 4)
    assert len(calls) == 1 and set(g.EXPORTED) == set(OPTIONS)
    with pytest.raises(ValueError, match="unknown generation option"):
        g.options(model, {"taux": 1})
