"""GenerationConfig's field metadata is the one schema of the generation options (decoding/schema.py): the CLI
flags, the server's request fields, the export's options and docs/guide/decoding.md's table are generated from it,
and a request is validated once: through the samplers, ``setdiff_mega.inference.generate`` and the server (its
per-sample seeds and the scheduler's shared-decode config are derived with ``GenerationConfig.derive``: the
changed fields checked, never the whole request again)."""
import argparse
import pickle
from dataclasses import replace
from pathlib import Path
from unittest import mock

import pytest

from setdiff_mega.config.objective import ObjectiveConfig
from setdiff_mega.decoding import schema
from setdiff_mega.decoding.base import Canvas, GenerationConfig
from setdiff_mega.decoding.config import BOUNDS, OPTIONS, REGENERATE
from setdiff_mega.decoding.setdlm import SetDLMSampler
from setdiff_mega.errors import RequestError
from setdiff_mega.inference import generate
from setdiff_mega.inference.options import FLAGS, add_generation_arguments, config_from_args
from setdiff_mega.serving.job import Job
from setdiff_mega.serving.protocol import DIFFUSION, SERVED, SHARED, ServerDefaults, config_of, parse
from setdiff_mega.serving.scheduler import Scheduler

from ..inference.mock import ScriptedModel, peaked
from ..serving_helpers import BOS, EOS, MASK, PAD, Tok, wait_done

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


def _model():
    return ScriptedModel(peaked([[(5, 3.0)]] * 40, 64), training_length=64)


def test_a_request_through_inference_generate_is_validated_once():
    """A config built by hand gets the model's context length in ``generate`` (a derived config: the changed field
    checked alone); a command line's config is used as it is."""
    calls, patch = _counting()
    with patch:
        cfg = GenerationConfig(max_new_tokens=4, window=4, stop_at_eos=False).validate()
        out = generate(_model(), _Tok(), "setdlm", [{"input_ids": [BOS, 3]}], cfg, context=64)
        assert len(calls) == 1 and out[0]["num_tokens"] == 4
        cli = config_from_args(_args("--max-new-tokens", "4", "--no-eos-stop"), ObjectiveConfig(name="setdlm", D=4),
                               64)
        generate(_model(), _Tok(), "setdlm", [{"input_ids": [BOS, 3]}], cli, context=64)
    assert len(calls) == 2                                 # one per request


def test_a_served_request_its_samples_and_its_shared_decode_are_validated_once():
    """parse validates the request; its n samples (seeds seed + j, each checked against the seed's bound) and the
    scheduler's shared-decode config (the first job's with max_new_tokens=1) are derived from it; the configs cross
    the pipe to the engine pickled, still validated; the samplers check none of them again."""
    d = ServerDefaults(objective=ObjectiveConfig(name="setdlm", D=4), seq_length=64, base=GenerationConfig())
    calls, patch = _counting()
    derived = []
    real_derive = GenerationConfig.derive

    def counted_derive(self, **changes):
        derived.append(changes)
        return real_derive(self, **changes)
    with patch, mock.patch.object(GenerationConfig, "derive", counted_derive):
        parsed = parse({"prompt": [BOS, 3], "max_tokens": 4, "n": 2, "seed": 5, "temperature": 1.0,
                        "stop_at_eos": False}, "completions", _Tok(), d)
        samples = pickle.loads(pickle.dumps(parsed.samples))   # as JobSpecs cross the pipe to the engine
        jobs = [Job(parsed.prompts[0], c, lambda *a: None, tokenizer=_Tok()) for c in samples]
        sch = Scheduler(_model(), _Tok(), "setdlm", max_batch=2).start()
        try:
            sch.submit(jobs)
            wait_done(jobs)
        finally:
            sch.close()
    assert len(calls) == 1
    assert [c.seed for c in samples] == [5, 6] and [len(j.tokens) for j in jobs] == [4, 4]
    assert derived == [{"seed": 5}, {"seed": 6}, {"max_new_tokens": 1}]    # the samples, then one shared decode
    with pytest.raises(RequestError, match="'n' = 2 samples from 'seed' 9223372036854775807: seed="):
        parse({"prompt": [BOS, 3], "n": 2, "seed": 2 ** 63 - 1}, "completions", _Tok(), d)


def test_a_derived_config_checks_its_changed_fields_and_the_rules_alone():
    calls, patch = _counting()
    with patch:
        base = GenerationConfig(window=4)
        cfg = base.derive(max_new_tokens=1)                # the parent validated first (once)
        assert len(calls) == 1 and cfg.max_new_tokens == 1 and base.max_new_tokens == 64
        assert cfg.validate() is cfg and len(calls) == 1   # derived: validated, free for the samplers
        for bad, why in [({"seed": 2 ** 63}, "seed="), ({"window": 0}, "window="), ({"taux": 1}, "unknown"),
                         ({"stop_repeat": 1}, "stop_repeat=1"), ({"speculative": True, "min_p": 0.5}, "min_p")]:
            with pytest.raises(ValueError, match=why):
                base.derive(**bad)
        replace(cfg, tau=-1.0)                             # a plain replace is a new, unchecked config
        with pytest.raises(ValueError, match="tau"):
            _decode(replace(cfg, tau=-1.0, max_new_tokens=4))
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
