"""Greedy tokens pinned across releases: every method (SetDLM with and without FHT cache order and the head
shift, AR, BD3LM, MDLM) on fixed prompts (plain, infill, past the context) of a seeded random model must decode
exactly the tokens recorded in ``data/golden_tokens.json``. The file was written once, by the release before
samplers became step functions (commit e7a13b1), and is never regenerated: a change here is a change of
decoding."""
import json
from pathlib import Path

import pytest
import torch

from setdiff_mega.decoding.base import Canvas, GenerationConfig
from setdiff_mega.inference.api import build_sampler

GOLDEN = Path(__file__).parent / "data" / "golden_tokens.json"
MASK, PAD, EOS, BOS = 60, 59, 58, 57
PROMPTS = [[BOS, 1, 2, 3, 4, 5], [BOS, 9], [BOS, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21],
           [BOS, 1, 2, MASK, MASK, MASK, MASK, 7, 8, EOS], [BOS, 3, MASK, MASK, MASK, MASK, MASK, 4, EOS]]
SETTINGS = {
    "setdlm_w4_tau0.5": ("setdlm", False, {"window": 4, "tau": 0.5}),
    "setdlm_w2_tau1e6": ("setdlm", False, {"window": 2, "tau": 1e6}),
    "setdlm_w4_ctx12": ("setdlm", False, {"window": 4, "tau": 0.7, "context_length": 12}),
    "setdlm_fht": ("setdlm+fht", False, {"window": 4, "tau": 0.5, "fht_cache_order": True, "context_length": 16}),
    "setdlm_shift_leftmost": ("setdlm", True, {"window": 4, "tau": 0.9, "commit_rule": "leftmost"}),
    "setdlm_shift_conf_k2": ("setdlm", True, {"window": 4, "tau": 0.9, "commit_rule": "confidence", "commit_k": 2}),
    "ar": ("ar", False, {}),
    "ar_ctx13": ("ar", False, {"context_length": 13}),
    "bd3lm_s4": ("bd3lm", False, {"block_size": 4, "tau": 0.5}),
    "bd3lm_s2_shift": ("bd3lm", True, {"block_size": 2, "tau": 0.9}),
    "mdlm_s4": ("mdlm", False, {"block_size": 4, "tau": 0.5}),
    "mdlm_s8_shift_ctx12": ("mdlm", True, {"block_size": 8, "tau": 0.7, "context_length": 12}),
}


class Tok:
    mask, pad, eos, bos = MASK, PAD, EOS, BOS


def golden_model():
    """The seeded random model (2 layers, hidden 32, large init std: context-dependent greedy outputs)."""
    from setdiff_mega.config import ModelConfig
    from setdiff_mega.model import build_model

    torch.manual_seed(0)
    mc = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, zero_init_head=False, init_method_std=0.5,
                     make_vocab_size_divisible_by=8)
    return build_model(mc, 61).eval()


@torch.no_grad()
def decode_all(model) -> dict:
    """{setting: [tokens per prompt]}, each prompt alone and the prompts as one batch."""
    from setdiff_mega.diffusion import SetDLMObjective

    out = {}
    for name, (method, shift, kw) in SETTINGS.items():
        model.shift_logits = shift
        m = SetDLMObjective(MASK, D=4) if method == "setdlm+fht" else method
        cfg = GenerationConfig(max_new_tokens=14, stop_at_eos=False, **kw)
        sampler = build_sampler(m, model, Tok(), cfg)
        alone = [sampler.generate(Canvas.from_prompts([p], MASK, PAD, cfg.max_new_tokens)).tokens[0] for p in PROMPTS]
        batch = sampler.generate(Canvas.from_prompts(PROMPTS, MASK, PAD, cfg.max_new_tokens)).tokens
        out[name] = {"alone": alone, "batch": batch}
    model.shift_logits = False
    return out


def test_greedy_tokens_equal_the_previous_release(mcore):
    want = json.loads(GOLDEN.read_text())
    got = decode_all(golden_model())
    assert set(got) == set(want)
    for name in SETTINGS:
        assert got[name] == want[name], name


if __name__ == "__main__":                 # the one-time writer (run against the previous release's code)
    from setdiff_mega.parallel import initialize

    initialize(seed=1234)
    if GOLDEN.exists():
        pytest.exit(f"{GOLDEN} exists: the golden tokens are never regenerated")
    GOLDEN.write_text(json.dumps(decode_all(golden_model()), indent=1) + "\n")
