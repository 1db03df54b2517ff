"""min_p sampling (transformers' MinPLogitsWarper, vLLM's min_p): added as one schema field (decoding/config.py)
and its filter (decoding/sampling.py); the CLI flag, the server field and the export option are generated."""
import argparse
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from setdiff_mega.config.objective import ObjectiveConfig
from setdiff_mega.decoding.base import Canvas, GenerationConfig
from setdiff_mega.decoding.sampling import RowOptions, choose_tokens, min_p_filter
from setdiff_mega.decoding.setdlm import SetDLMSampler
from setdiff_mega.errors import RequestError
from setdiff_mega.inference.options import add_generation_arguments, config_from_args
from setdiff_mega.serving.protocol import ServerDefaults, config_of

from ..inference.mock import ScriptedModel, peaked
from ..serving_helpers import BOS, EOS, MASK, PAD

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("min_p", [0.0, 0.05, 0.3, 0.9, 1.0])
@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_min_p_filter_matches_transformers_warper(min_p, temperature):
    logits_process = pytest.importorskip("transformers.generation.logits_process")
    if not hasattr(logits_process, "MinPLogitsWarper"):
        pytest.skip("this transformers has no MinPLogitsWarper")
    scores = torch.randn(3, 5, 50, generator=torch.Generator().manual_seed(0)) * 3 / temperature
    flat = scores.reshape(-1, 50)
    want = torch.softmax(logits_process.MinPLogitsWarper(min_p)(None, flat.clone()), -1) if min_p > 0 else \
        torch.softmax(flat, -1)
    got = min_p_filter(torch.softmax(flat, -1), min_p)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    kept = got > 0
    assert kept.any(-1).all() and (min_p < 0.3 or (kept.sum(-1) < 50).all())


def test_choose_tokens_draws_and_scores_only_the_kept_tokens():
    logits = torch.log(torch.tensor([[[0.5, 0.3, 0.15, 0.05]]]))
    tok, conf = choose_tokens(logits, [], 0.0, min_p=0.5)              # greedy: keeps 0.5 and 0.3, renormalised
    assert tok.item() == 0 and conf.item() == pytest.approx(0.5 / 0.8)
    tok, conf = choose_tokens(logits.expand(1, 400, 4), [], 1.0, generator=torch.Generator().manual_seed(0),
                              min_p=0.5)
    assert set(tok.flatten().tolist()) == {0, 1}
    torch.testing.assert_close(conf, torch.where(tok == 0, 0.5 / 0.8, 0.3 / 0.8))
    same, _ = choose_tokens(logits, [], 0.0)                          # 0: off, unchanged
    assert same.item() == 0 and RowOptions.of(GenerationConfig(min_p=0.2)).choice()["min_p"] == 0.2


@pytest.mark.slow
def test_the_generate_tool_has_the_min_p_flag():
    """The real command line (a subprocess: imports the whole stack, slow on a loaded machine)."""
    out = subprocess.run([sys.executable, str(ROOT / "tools/generate.py"), "--help"], capture_output=True,
                         text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0 and "--min-p" in out.stdout, out.stderr[-2000:]


def test_min_p_is_on_the_cli_the_server_and_the_export_without_editing_them():
    from setdiff_mega.hfmodel.generation_setdlm import EXPORTED

    assert "min_p" in EXPORTED
    p = argparse.ArgumentParser()
    add_generation_arguments(p)
    o = ObjectiveConfig(name="setdlm", D=4)
    assert config_from_args(p.parse_args(["--min-p", "0.1"]), o, 64).min_p == 0.1
    d = ServerDefaults(objective=o, seq_length=64, base=GenerationConfig())
    assert config_of({"min_p": 0.25}, d).min_p == 0.25
    for bad, why in [(1.5, r"min_p=1.5 must be in \[0, 1\]"), ("x", "'min_p' must be a number")]:
        with pytest.raises(RequestError, match=why):
            config_of({"min_p": bad}, d)
    with pytest.raises(ValueError, match="speculative=True does not combine with min_p"):
        GenerationConfig(min_p=0.1, speculative=True).validate()


def test_a_sampled_decode_never_commits_a_token_below_min_p():
    """Token 9 has a tenth of token 5's probability: sampled at min_p 0.2 it never appears; at 0 it does."""
    table = peaked([[(5, 3.0), (7, 2.9), (9, 3.0 - 2.302585)]] * 80, 64, floor=-30.0)

    def tokens(min_p):
        cfg = GenerationConfig(max_new_tokens=60, temperature=1.0, tau=2.0, window=1, min_p=min_p, seed=3,
                               stop_at_eos=False).validate()
        out = SetDLMSampler(ScriptedModel(table), MASK, PAD, EOS, cfg).generate(
            Canvas.from_prompts([[BOS, 3]], MASK, PAD, cfg.max_new_tokens))
        return set(out.tokens[0])

    assert tokens(0.2) == {5, 7} and 9 in tokens(0.0)
