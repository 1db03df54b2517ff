"""The reference's decoding protocol (method.md 5.1-5.5, P10-P17) on a scripted backbone: EOS with PAD == EOS,
the minimum length, logits processors, stopping criteria and their cadence, FHT-ordered cache writes,
prefix-only infill context. Every expected value here is computed by hand from the scripted logits."""
import pytest
import torch
from transformers.generation.logits_process import ExponentialDecayLengthPenalty, RepetitionPenaltyLogitsProcessor

from setdiff_mega.decoding.context import Ledger
from setdiff_mega.decoding.processors import length_penalty, prefix_lengths, repetition_context, repetition_penalty
from setdiff_mega.decoding.setdlm import first_hitting_times
from setdiff_mega.diffusion import SetDLMObjective
from setdiff_mega.inference import (
    ARSampler,
    BD3LMSampler,
    Canvas,
    GenerationConfig,
    MDLMSampler,
    SetDLMSampler,
    StopCriteria,
    choose_tokens,
)

from .mock import ScriptedModel, peaked

V, MASK, EOS, BOS = 12, 11, 10, 9
PAD = EOS                          # GPT-2 / Qwen style: PAD == EOS
SAMPLERS = [(SetDLMSampler, {"window": 2, "tau": 2.0}), (ARSampler, {}), (BD3LMSampler, {"block_size": 2, "tau": 2.0}),
            (MDLMSampler, {"block_size": 2, "tau": 2.0})]


def decode(model, prompts, cls=SetDLMSampler, prior=None, tokenizer=None, **kw):
    kw.setdefault("max_new_tokens", 8)
    cfg = GenerationConfig(**kw)
    return cls(model, MASK, PAD, EOS, cfg, tokenizer=tokenizer, order_prior=prior).generate(
        Canvas.from_prompts(prompts, MASK, PAD, cfg.max_new_tokens))


def ladder(n: int, token: int, vocab: int = V) -> torch.Tensor:
    """Every position prefers ``token``, more confidently further left (so W-windows fill left to right)."""
    return peaked([[(token, 6.0 - 0.1 * p), (MASK, 9.0)] for p in range(n)], vocab)


# ---- EOS ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cls,kw", SAMPLERS)
def test_eos_is_generated_and_stops_when_pad_equals_eos(cls, kw):
    model = ScriptedModel(peaked([[(EOS, 5.0), (MASK, 9.0)]] * 40, V))     # MASK's logit is highest: never chosen
    out = decode(model, [[BOS, 1]], cls, **kw)
    assert out.tokens == [[EOS]]                                          # the first generated token ends the text
    late = decode(model, [[BOS, 1]], cls, min_new_tokens=3, **kw)
    assert late.tokens == [[EOS, EOS, EOS]]                               # earlier EOS stay; the 3rd may stop


def test_eos_before_the_minimum_does_not_end_the_document():
    table = peaked([[(3, 5.0)]] * 3 + [[(EOS, 5.0)]] + [[(4, 5.0)]] * 3 + [[(EOS, 5.0)]] + [[(5, 5.0)]] * 8, V)
    model = ScriptedModel(table)
    assert decode(model, [[BOS]], window=1, tau=2.0).tokens == [[3, 3, EOS]]
    assert decode(model, [[BOS]], window=1, tau=2.0, min_new_tokens=4).tokens == [[3, 3, EOS, 4, 4, 4, EOS]]
    assert decode(model, [[BOS]], window=1, tau=2.0, stop_at_eos=False).tokens == [[3, 3, EOS, 4, 4, 4, EOS, 5]]


# ---- processors ---------------------------------------------------------------------------------------

def test_repetition_penalty_equals_transformers_on_every_row():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, V, generator=g)
    tokens = torch.randint(0, V - 1, (3, 9), generator=g)
    ctx = torch.rand(3, 9, generator=g) < 0.5
    got = repetition_penalty(logits, tokens, ctx, 1.7)
    for b in range(3):
        ids = tokens[b][ctx[b]][None]
        want = RepetitionPenaltyLogitsProcessor(1.7)(ids.expand(4, -1), logits[b].clone())
        assert torch.allclose(got[b], want)


def test_length_penalty_equals_transformers_on_every_row():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 5, V, generator=g)
    prefix = torch.tensor([[0, 2, 3, 5, 9], [1, 4, 4, 6, 2]])
    got = length_penalty(logits, prefix, EOS, 3, 1.3)
    for b in range(2):
        for a in range(5):
            proc = ExponentialDecayLengthPenalty((3, 1.3), EOS, 0)
            want = proc(torch.zeros(1, int(prefix[b, a]), dtype=torch.long), logits[b, a][None].clone())[0]
            assert torch.allclose(got[b, a], want)


def test_contexts_of_the_processors():
    # row 0: plain prompt [BOS 1 2] + 3 generated (gen 0 and 2 committed); row 1: infill BOS 1 [M M] 4 EOS
    tokens = torch.tensor([[BOS, 1, 2, 5, MASK, 6], [BOS, 1, 7, MASK, 4, EOS]])
    masked = tokens == MASK
    generate = torch.tensor([[0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 0, 0]], dtype=torch.bool)
    valid = torch.ones_like(generate)
    ctx = repetition_context(tokens, masked, generate, valid, torch.tensor([False, True]))
    assert ctx.tolist() == [[False, False, False, True, False, True], [True, True, True, False, True, True]]
    pre = prefix_lengths(torch.tensor([[4, 5], [3, 2]]), masked, generate, valid)
    assert pre.tolist() == [[1, 1], [1, 0]]               # visible generated tokens left of each position


def test_nucleus_renormalises_the_greedy_confidence():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    tok, conf = choose_tokens(logits, [], temperature=0.0, top_p=0.6)
    assert tok.item() == 0 and conf.item() == pytest.approx(0.5 / 0.8)


def test_repetition_penalty_steers_decoding_and_sees_the_right_context():
    # every position prefers token 2 (logit 2.0) over token 3 (1.8): with a penalty of 1.5 a seen 2 loses
    model = ScriptedModel(peaked([[(2, 2.0), (3, 1.8)]] * 20, V))
    assert decode(model, [[BOS]], window=1, tau=2.0, max_new_tokens=3).tokens == [[2, 2, 2]]
    # gen 1: 2 seen -> 2.0 / 1.5 = 1.33 < 1.8; gen 2: both seen -> 1.33 > 1.8 / 1.5 = 1.2
    assert decode(model, [[BOS]], window=1, tau=2.0, max_new_tokens=3, repetition_penalty=1.5).tokens == [[2, 3, 2]]
    infill = decode(model, [[BOS, MASK, MASK, 2, EOS]], window=1, tau=2.0, repetition_penalty=1.5)
    assert infill.tokens == [[3, 2]]          # the suffix's 2 (right context) is penalised from the first token on


def test_length_penalty_raises_eos_after_its_start():
    model = ScriptedModel(peaked([[(EOS, -1.0), (4, 1.0)]] * 20, V, floor=-9.0))
    assert decode(model, [[BOS]], window=1, tau=2.0).tokens == [[4] * 8]
    # c visible generated tokens to the left: EOS = -1 + |-1| (10^(c-2) - 1) > 1 first at c = 3
    assert decode(model, [[BOS]], window=1, tau=2.0, length_penalty=(2, 10.0)).tokens == [[4, 4, 4, EOS]]


# ---- stopping criteria --------------------------------------------------------------------------------

class CharTokenizer:
    """id i decodes to CHARS[i] (MASK -> '?')."""
    CHARS = "ab{}x\\boxed"

    def decode(self, ids):
        return "".join("?" if i == MASK else "#" if i in (EOS, BOS) else self.CHARS[i] for i in ids)

    def token(self, i):
        return "?"


def criteria(tokens, **kw):
    tokens = torch.tensor(tokens)
    gen = torch.zeros_like(tokens, dtype=torch.bool)
    gen[:, 2:] = True
    canvas = Canvas(tokens, gen, torch.ones_like(gen), torch.zeros(tokens.shape[0], dtype=torch.bool))
    return StopCriteria(GenerationConfig(**kw), CharTokenizer(), canvas, MASK), tokens, tokens == MASK


def test_regex_counts_the_prompt_and_ignores_matches_with_mask():
    # prompt "{a}" with one match; row 0 generates "{b}" (2 matches), row 1 "{?}" (the masked one is ignored)
    c, tokens, masked = criteria([[2, 0, 3, 2, 1, 3], [2, 0, 3, 2, MASK, 3]], stop_regex=r"\{.\}", stop_regex_count=2)
    fired, end = c(tokens, masked, torch.ones(2, 6), torch.zeros(2, dtype=torch.bool), torch.tensor([6, 6]))
    assert fired.tolist() == [True, False] and end[0] == 6



def test_regex_falls_back_to_python_re_with_one_warning_without_re2(monkeypatch, caplog):
    """An export loaded where google-re2 is not installed: stop_regex runs on Python's re (a warning the first
    time only), and stops as on RE2; a pattern re cannot compile is a one-line ValueError."""
    import re

    from setdiff_mega.decoding import stopping

    monkeypatch.setattr(stopping, "re2", None)
    monkeypatch.setattr(stopping, "_warned", False)
    with caplog.at_level("WARNING", logger=stopping.__name__):
        assert isinstance(stopping.compile_stop_regex(r"(a)\1"), re.Pattern)      # backreferences: re has them
        c, tokens, masked = criteria([[2, 0, 3, 2, 1, 3], [2, 0, 3, 2, MASK, 3]], stop_regex=r"\{.\}",
                                     stop_regex_count=2)
    fired, end = c(tokens, masked, torch.ones(2, 6), torch.zeros(2, dtype=torch.bool), torch.tensor([6, 6]))
    assert fired.tolist() == [True, False] and end[0] == 6
    warned = [r for r in caplog.records if "google-re2" in r.getMessage()]
    assert len(warned) == 1 and "\n" not in warned[0].getMessage()
    with pytest.raises(ValueError, match="is not a regular expression"):
        stopping.compile_stop_regex("(")

def test_repeat_run_ends_at_the_last_committed_token():
    rows = [[BOS, 1, 4, 4, 4, MASK], [BOS, 1, 4, MASK, 4, 4], [BOS, 1, 0, 4, 4, 4]]
    c, tokens, masked = criteria(rows, stop_repeat=3)
    fired, _ = c(tokens, masked, torch.ones(3, 6), torch.zeros(3, dtype=torch.bool), torch.tensor([6, 6, 5]))
    assert fired.tolist() == [True, False, False]          # row 2: only [0, 4, 4] lies inside its limit 5


def test_low_confidence_needs_patience_carries_strikes_and_skips_the_minimum():
    tokens = [[BOS, 1, 4, 4, 4, 4, 4, 4]]
    conf = torch.tensor([[1.0, 1.0, 0.5, 0.001, 0.002, 0.003, 0.9, 0.001]])
    c, tok, _ = criteria(tokens, stop_confidence=0.01, stop_patience=3)
    masked = torch.tensor([[False] * 5 + [True] * 3])
    none = torch.zeros(1, dtype=torch.bool)
    assert c(tok, masked, conf, none, torch.tensor([8]))[0].tolist() == [False]    # two strikes (pos 3, 4)
    fired, end = c(tok, torch.zeros_like(masked), conf, none, torch.tensor([8]))
    assert fired.tolist() == [True] and end.tolist() == [6]                        # third strike at pos 5
    c2, tok, _ = criteria(tokens, stop_confidence=0.01, stop_patience=3, min_new_tokens=2)
    fired, _ = c2(tok, torch.zeros_like(masked), conf, none, torch.tensor([8]))
    assert fired.tolist() == [False]                        # positions 2, 3 are skipped: only 2 strikes follow


def test_low_entropy_truncates_a_window_back():
    c, tok, masked = criteria([[BOS, 1] + [4] * 8 + [0, 1]], stop_entropy=0.5, stop_entropy_window=4)
    fired, end = c(tok, masked, torch.ones(1, 12), torch.zeros(1, dtype=torch.bool), torch.tensor([10]))
    assert fired.tolist() == [True] and end.tolist() == [6]             # max(10 - 4, start 2 + 0)
    fired, _ = c(tok, masked, torch.ones(1, 12), torch.zeros(1, dtype=torch.bool), torch.tensor([12]))
    assert fired.tolist() == [False]                                   # [4, 4, 0, 1]: entropy 1.04 nats


@pytest.mark.parametrize("W,expected", [(2, 3), (3, 4), (1, 2)])
def test_setdlm_checks_every_w_steps_and_truncates_at_the_window(W, expected):
    """One token per step, left to right: the run of 2 exists after step 1, but the criterion is read after
    steps i > 0 with i % W == 0 only; the output then ends at f_new + W (MASK dropped)."""
    out = decode(ScriptedModel(ladder(30, 4)), [[BOS]], window=W, tau=2.0, max_new_tokens=12, stop_repeat=2)
    assert out.tokens == [[4] * expected] and out.steps == [expected]


def test_ar_checks_every_step_and_blocks_at_their_end():
    assert decode(ScriptedModel(ladder(30, 4)), [[BOS]], ARSampler, stop_repeat=2).tokens == [[4, 4]]
    out = decode(ScriptedModel(ladder(30, 4)), [[BOS]], BD3LMSampler, block_size=4, tau=2.0, stop_repeat=2)
    assert out.tokens == [[4, 4, 4]]                      # block [0, 4) complete after 3 steps: stop, cut at 4


# ---- context, FHT order, infill context ---------------------------------------------------------------

def test_ledger_evicts_oldest_or_smallest_positions_and_keeps_history_visibility():
    for by_pos, gone in ((False, [5, 3]), (True, [3, 1])):
        led = Ledger(1, 8, budget=4, by_position=torch.tensor([by_pos]))
        led.append(torch.tensor([[5, 3, 9, 1]]), torch.ones(1, 4, dtype=torch.bool), forward=0)
        keep = led.evict_for(torch.tensor([2]), forward=1)       # 4 cached + 2 new > 4: drop 2
        assert sorted(led.pos[0][led.gone[0] == 1].tolist()) == sorted(gone)
        assert keep[0, :4].tolist() == [p not in gone for p in (5, 3, 9, 1)]
        led.append(torch.tensor([[7]]), torch.ones(1, 1, dtype=torch.bool), forward=1)
        _, _, mask = led.history()
        assert mask[0, 4, :4].tolist() == [p not in gone for p in (5, 3, 9, 1)]   # the new token never saw them
        assert mask[0, 3, :4].all()                                              # the old ones saw each other


def test_fht_order_writes_same_step_commits_by_descending_hitting_time():
    prior = SetDLMObjective(MASK, D=4)
    canvas = Canvas.from_prompts([[BOS]], MASK, PAD, 8)
    seed = next(s for s in range(100)                     # a draw whose first window is not in position order
                if (lambda t: sorted(range(1, 5), key=lambda p: -t[p].item()) != [1, 2, 3, 4])(
                    first_hitting_times(canvas, GenerationConfig(window=4, seed=s), 32, prior)[0]))
    fht = first_hitting_times(canvas, GenerationConfig(window=4, seed=seed), 32, prior)[0]
    model = ScriptedModel(ladder(40, 4), training_length=32)
    out = decode(model, [[BOS]], prior=prior, window=4, tau=0.0, max_new_tokens=8, fht_cache_order=True, seed=seed)
    assert out.tokens == [[4] * 8]
    step1 = model.calls[2]["positions"][0][:4]             # calls: prefill, step 0, step 1 = [step-0 commits ; window]
    assert step1 == sorted(range(1, 5), key=lambda p: -fht[p].item()) and step1 != [1, 2, 3, 4]
    plain = ScriptedModel(ladder(40, 4), training_length=32)
    decode(plain, [[BOS]], window=4, tau=0.0, max_new_tokens=8)
    assert plain.calls[2]["positions"][0][:4] == [1, 2, 3, 4]


def test_fht_eviction_drops_the_smallest_positions_and_all_cached_tokens_stay_visible():
    """W = 3, tau = 0 (a whole window per step), budget 8: before each forward 3 pending + 3 queries leave
    room for 2 cached tokens, which must be the 2 largest committed positions whatever the FHT write order."""
    prior = SetDLMObjective(MASK, D=4)
    model = ScriptedModel(ladder(60, 4), training_length=8)
    out = decode(model, [[BOS]], prior=prior, window=3, tau=0.0, max_new_tokens=24, fht_cache_order=True)
    assert out.tokens == [[4] * 24] and out.evicted > 0
    for call in model.calls[3:]:
        pos = call["positions"][0]
        pending, queries = pos[:3], pos[3:]
        cached = [p for p in call["seen"][0][-1] if p not in pos]
        assert cached == [min(pending) - 2, min(pending) - 1], (pos, cached)
        assert set(call["seen"][0][-1]) == set(cached) | set(pending) | {queries[-1]}


@pytest.mark.parametrize("full", [True, False])
def test_infill_context_full_or_prefix_only(full):
    # BOS 1 [M M] 4 [M M] 7: W = 4 reaches the second span at step 0
    model = ScriptedModel(ladder(20, 5))
    out = decode(model, [[BOS, 1, MASK, MASK, 4, MASK, MASK, 7]], window=4, tau=0.0, infill_full_context=full)
    assert out.tokens == [[5, 5, 5, 5]]
    assert model.calls[0]["positions"][0] == ([0, 1, 4, 7] if full else [0, 1])          # the prefill
    if not full:
        # step 0 committed 2, 3, 5; the 4 left of 5 joins the cache with them, in position order
        assert model.calls[2]["positions"][0][:4] == [2, 3, 4, 5]
        assert all(7 not in seen for call in model.calls for seen in call["seen"][0])   # the suffix: never seen


# ---- options ------------------------------------------------------------------------------------------

def test_generation_options_from_strings_and_presets():
    from setdiff_mega.config import ObjectiveConfig
    from setdiff_mega.inference.options import generation_config

    cfg = GenerationConfig.from_strings({"tau": "0.5", "fht_cache_order": "true", "length_penalty": "80:1.1",
                                         "stop_confidence": "0.01", "stop_strings": "A|B", "context_length": "None"})
    assert (cfg.tau, cfg.fht_cache_order, cfg.length_penalty, cfg.stop_confidence, cfg.stop_strings,
            cfg.context_length) == (0.5, True, (80, 1.1), 0.01, ("A", "B"), None)
    with pytest.raises(ValueError, match="unknown generation option 'tua'"):
        GenerationConfig.from_strings({"tua": "1"})
    with pytest.raises(ValueError, match="is not a regular expression"):
        GenerationConfig(stop_regex="(").validate()
    with pytest.raises(ValueError, match="expected START,FACTOR"):
        GenerationConfig.from_strings({"length_penalty": "80"})
    o = ObjectiveConfig(name="setdlm", D=8)
    g = generation_config(o, 1024, "gsm8k")
    assert (g.window, g.tau, g.fht_cache_order, g.stop_regex_count, g.stop_repeat, g.context_length) == \
        (8, 0.9, True, 2, 8, 1024)
    assert generation_config(o, 1024, "infill", {"tau": 0.5}).window == 16
    assert generation_config(ObjectiveConfig(name="bd3lm", block_size=16), 256).block_size == 16


def test_readme_maps_every_generation_option_to_the_reference():
    from dataclasses import fields
    from pathlib import Path

    guide = (Path(__file__).resolve().parents[2] / "docs/guide/decoding.md").read_text()
    table = guide[guide.index("<!-- options:begin -->"):guide.index("<!-- options:end -->")]
    missing = [f.name for f in fields(GenerationConfig) if f.name != "record" and f"`{f.name}" not in table]
    assert not missing, f"docs/guide/decoding.md's options table lacks {missing}"
