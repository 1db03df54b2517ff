"""The AR head alignment (``model.shift_logits``, method.md 13) in the objectives and the samplers.

Training: the row each target reads never saw the target's clean token (changing it leaves the target's
logits unchanged) and is its predecessor's where that is leak-free. Decoding: the cache changes nothing,
batching changes nothing, and one token per step left to right reads exactly the training rows: SetDLM with
W = 1 and BD3LM with blocks of one decode the argmax of the identity-order training queries, which are the
clean rows of the previous positions, i.e. greedy AR decoding of the same network.
"""
import pytest
import torch

from setdiff_mega.diffusion import build_objective
from setdiff_mega.inference import BD3LMSampler, Canvas, GenerationConfig, MDLMSampler, SetDLMSampler

from .mock import Shifted

MASK, PAD, EOS = 60, 59, 58
PROMPTS = {
    "prompt": [[57, 1, 2, 3, 4, 5], [57, 9]],
    "infill": [[57, 1, 2, MASK, MASK, MASK, MASK, MASK, 7, 8, EOS], [57, 3, MASK, MASK, MASK, 4, MASK, MASK, 9, EOS]],
}


def _run(cls, model, prompts, **kw):
    kw.setdefault("max_new_tokens", 10)
    kw.setdefault("stop_at_eos", False)
    cfg = GenerationConfig(**kw)
    return cls(model, MASK, PAD, EOS, cfg).generate(Canvas.from_prompts(prompts, MASK, PAD, cfg.max_new_tokens))


@torch.no_grad()
@pytest.mark.parametrize("name,options", [("setdlm", {"D": 2}), ("setdlm", {"D": 1}), ("bd3lm", {"block_size": 4}),
                                          ("mdlm", {})])
def test_the_rows_targets_read_never_saw_their_token(rand_model, name, options):
    tokens = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(3))
    obj = build_objective(name, MASK, shift_logits=True, **options)
    inp = obj.build_inputs(tokens, generator=torch.Generator().manual_seed(4))
    logits = inp.target_logits(rand_model(**inp.model_kwargs()))
    if name == "setdlm":                       # with the shift, most targets read a clean (predecessor) row
        assert (inp.logit_rows < 16).float().mean() > 0.3
        perm, rank = inp.extras["perm"], inp.extras["rank"]
        pred_first = rank.gather(1, (perm - 1).clamp(min=0)) < torch.arange(16)
        assert torch.equal(inp.logit_rows < 16, pred_first & (perm > 0))
    for b, n in [(0, 5), (1, 9), (0, 15)] if inp.tokens.shape[1] > 16 else []:     # two streams: clean copy n
        if not inp.loss_mask[b, n]:
            continue
        changed = inp.tokens.clone()
        changed[b, n] = (inp.targets[b, n] + 1) % 50
        again = inp.target_logits(rand_model(changed, inp.position_ids, inp.attention_mask, inp.logits_start))
        torch.testing.assert_close(again[b, n], logits[b, n])
    plain = build_objective(name, MASK, **options).build_inputs(tokens, generator=torch.Generator().manual_seed(4))
    assert plain.logit_rows is None and torch.equal(plain.tokens, inp.tokens)       # the same noise either way


@pytest.mark.parametrize("kind", list(PROMPTS))
@pytest.mark.parametrize("cls,kw", [(SetDLMSampler, {"window": 1, "tau": 2.0}),
                                    (SetDLMSampler, {"window": 4, "tau": 0.5}),
                                    (SetDLMSampler, {"window": 3, "tau": 0.9, "commit_k": 2}),
                                    (SetDLMSampler, {"window": 4, "tau": 0.5, "commit_rule": "leftmost"}),
                                    (SetDLMSampler, {"window": 4, "tau": 2.0, "commit_rule": "leftmost"}),
                                    (BD3LMSampler, {"block_size": 4, "tau": 0.5, "commit_rule": "leftmost"}),
                                    (BD3LMSampler, {"block_size": 4, "tau": 0.5}),
                                    (BD3LMSampler, {"block_size": 3, "tau": 1.5})])
def test_shifted_decoding_is_cache_exact_and_batch_invariant(rand_model, kind, cls, kw):
    model = Shifted(rand_model)
    a = _run(cls, model, PROMPTS[kind], use_cache=True, **kw)
    b = _run(cls, model, PROMPTS[kind], use_cache=False, **kw)
    assert a.tokens == b.tokens
    for i, p in enumerate(PROMPTS[kind]):
        assert _run(cls, model, [p], **kw).tokens[0] == a.tokens[i]
    assert a.tokens != _run(cls, rand_model, PROMPTS[kind], **kw).tokens      # the shift is read


@torch.no_grad()
def test_the_leftmost_rule_at_high_tau_decodes_left_to_right_as_window_one(rand_model):
    """commit_rule="leftmost" with tau > 1 commits the leftmost masked position every step, whatever the window: the
    tokens of W = 4 equal those of W = 1 (which has only that position), one token per step, for both heads; the
    paper's rule at W = 4 commits elsewhere (the random model's confidences are not left to right). The default
    ("auto") is the leftmost rule for the shifted SetDLM and the paper's for the unshifted one and for BD3LM."""
    prompts = PROMPTS["prompt"]
    for model in (rand_model, Shifted(rand_model)):
        one = _run(SetDLMSampler, model, prompts, window=1, tau=2.0)
        left = _run(SetDLMSampler, model, prompts, window=4, tau=2.0, commit_rule="leftmost")
        assert left.tokens == one.tokens and all(s == len(t) for s, t in zip(left.steps, left.tokens))
        paper = _run(SetDLMSampler, model, prompts, window=4, tau=2.0, commit_rule="confidence")
        assert paper.tokens != one.tokens
        auto = _run(SetDLMSampler, model, prompts, window=4, tau=2.0)
        assert auto.tokens == (left.tokens if isinstance(model, Shifted) else paper.tokens)
        bd = [_run(BD3LMSampler, model, prompts, block_size=4, tau=2.0, commit_rule=r).tokens
              for r in ("auto", "confidence")]
        assert bd[0] == bd[1]


@torch.no_grad()
def test_one_token_per_step_decodes_the_training_rows_left_to_right(rand_model):
    """SetDLM W = 1 and BD3LM blocks of one both decode the argmax of the shifted identity-order training
    queries on their own output: the clean row of p - 1 predicts p, as an AR model does."""
    model = Shifted(rand_model)
    prompt = [[57, 1, 2, 3]]
    setdlm = _run(SetDLMSampler, model, prompt, window=1, tau=2.0, max_new_tokens=8)
    bd3lm = _run(BD3LMSampler, model, prompt, block_size=1, tau=2.0, max_new_tokens=8)
    assert setdlm.tokens == bd3lm.tokens
    seq = torch.tensor([setdlm.sequences[0]])
    L = seq.shape[1]
    inp = build_objective("setdlm", MASK, D=1, shift_logits=True).build_inputs(seq, perm=torch.arange(L)[None])
    assert inp.logit_rows[0, 1:].tolist() == list(range(L - 1))                 # clean row p - 1
    logits = inp.target_logits(rand_model(**inp.model_kwargs()))
    logits[..., MASK] = float("-inf")
    assert logits.argmax(-1)[0, 4:].tolist() == setdlm.tokens[0]


def test_mdlm_reads_the_previous_position(rand_model):
    model = Shifted(rand_model)
    a = _run(MDLMSampler, model, PROMPTS["prompt"], block_size=4, tau=0.5)
    assert a.tokens != _run(MDLMSampler, rand_model, PROMPTS["prompt"], block_size=4, tau=0.5).tokens
    for i, p in enumerate(PROMPTS["prompt"]):
        assert _run(MDLMSampler, model, [p], block_size=4, tau=0.5).tokens[0] == a.tokens[i]


def test_context_parallelism_refuses_the_shift():
    from setdiff_mega.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"model.shift_logits .*context_parallel_size=2 .*use CP=1"):
        load_config(None, ["model.shift_logits=true", "parallel.context_parallel_size=2",
                           "model.attention_backend=flex", "data.seq_length=16"])


@pytest.mark.parametrize("name,options", [("setdlm", {"D": 2}), ("mdlm", {}), ("bd3lm", {"block_size": 4})])
def test_likelihoods_read_the_shifted_rows(rand_model, name, options):
    """sequence_nll (and its NELBO objective) scores the rows the shifted objective's loss reads."""
    from setdiff_mega.data.batch import Batch
    from setdiff_mega.diffusion import inputs_for
    from setdiff_mega.eval.likelihood import elbo_objective, sequence_nll

    tokens = torch.randint(0, 50, (1, 32), generator=torch.Generator().manual_seed(5))
    obj = build_objective(name, MASK, shift_logits=True, **options)
    elbo = elbo_objective(obj)
    assert elbo.shift_logits
    got = sequence_nll(rand_model, obj, tokens, seed=3)
    inp = inputs_for(elbo, Batch(tokens, [0]), 3, training=False)     # row 0, draw 0: sample id 0
    assert inp.loss_mask.sum() > 0
    with torch.no_grad():
        loss, stats = elbo.loss(rand_model(**inp.model_kwargs()), inp)
    assert float(got["nll"][0]) == pytest.approx(float(stats["nll_sum"]), rel=1e-5)
    plain = sequence_nll(rand_model, build_objective(name, MASK, **options), tokens, seed=3)
    assert float(plain["nll"][0]) != pytest.approx(float(got["nll"][0]), rel=1e-3)
