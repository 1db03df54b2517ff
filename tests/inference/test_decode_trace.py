"""The decoding trace (setdiff_mega/decoding/trace.py, issue 40) is exact: replaying its commits in step order
rebuilds the sampler's canvas after every step and ends on the generated tokens, for every method (plain
prompts and infills, greedy and sampled); each token's window / block start is where the sampler could commit
it from; the JSON form round-trips."""
import pytest
import torch

from setdiff_mega.decoding.base import Canvas, GenerationConfig
from setdiff_mega.decoding.trace import MASK_FRAME, DecodeTrace, traces
from setdiff_mega.inference.api import build_sampler

from .test_serving_batching import MASK, PAD, PROMPTS, Tok

CASES = [("setdlm", {"window": 4, "tau": 0.5}), ("setdlm", {"window": 2, "tau": 1e6}),
         ("setdlm", {"window": 4, "tau": 0.7, "temperature": 1.0, "seed": 3}), ("ar", {}),
         ("bd3lm", {"block_size": 4, "tau": 0.5}), ("mdlm", {"block_size": 4, "tau": 0.5})]


@pytest.mark.parametrize("method,kw", CASES, ids=[f"{m}-{kw}" for m, kw in CASES])
@torch.no_grad()
def test_replaying_the_trace_rebuilds_every_step_and_the_generated_tokens(rand_model, method, kw):
    cfg = GenerationConfig(max_new_tokens=10, stop_at_eos=False, record=True, **kw)
    canvas = Canvas.from_prompts(PROMPTS, MASK, PAD, cfg.max_new_tokens)
    out = build_sampler(method, rand_model, Tok(), cfg).generate(canvas)
    rows = traces(method, canvas, out, cfg)
    assert len(rows) == len(PROMPTS) and len(out.trace) == max(t.num_steps for t in rows)
    for b, t in enumerate(rows):
        assert t.tokens == out.tokens[b] and len(t.positions) == len(t.steps) == len(t.confidences) == len(t.tokens)
        frames = t.replay()
        assert frames[-1] == t.tokens                                  # every generated token, at its place
        for s, frame in enumerate(frames):                             # and every step as the sampler saw it
            canvas_s = out.trace[s][b]
            for j, p in enumerate(t.positions):
                assert frame[j] == (int(canvas_s[p]) if t.steps[j] <= s else MASK_FRAME), (b, s, j)
                if t.steps[j] > s:
                    assert int(canvas_s[p]) == MASK
        for p, w, s in zip(t.positions, t.window, t.steps):
            assert w <= p
            if method == "setdlm":                                     # inside the window: W masked positions
                masked_then = [q for q, s2 in zip(t.positions, t.steps) if s2 >= s and w <= q <= p]
                assert len(masked_then) <= kw["window"], (b, p, w)
            elif method == "ar":
                assert w == p
            else:
                assert (p - w) < kw["block_size"]
        assert 0.0 <= min(t.confidences) and max(t.confidences) <= 1.0 + 1e-6
        assert DecodeTrace.from_json(t.to_json()) == t


def test_a_trace_file_without_its_fields_is_refused_with_a_clear_message():
    with pytest.raises(ValueError, match="not a decoding trace: the fields positions, tokens"):
        DecodeTrace.from_json('{"method": "ar", "prompt": [], "steps": [], "confidences": []}')
