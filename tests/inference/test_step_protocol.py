"""Samplers as step functions (setdiff_mega/decoding/calls.py): every method's session, driven by hand with rows
joining and leaving between steps, decodes each request's batch-1 tokens; a session of many slots with one busy
row costs a one-row forward; the protocol refuses misuse."""
import pytest
import torch

from setdiff_mega.decoding.base import Canvas, GenerationConfig
from setdiff_mega.decoding.baselines import ARSession, BD3LMSession, MDLMSession
from setdiff_mega.decoding.calls import forward
from setdiff_mega.decoding.runner import ChunkRunner
from setdiff_mega.decoding.session import Sampler, Session
from setdiff_mega.decoding.setdlm import SetDLMSession, SpeculativeSession
from setdiff_mega.inference.api import build_sampler

from .test_serving_batching import MASK, METHODS, PAD, PROMPTS, Tok, _alone, _method
from .test_speculative import Spec

GREEDY = [(m, kw) for m, kw in METHODS if "temperature" not in kw]


def _sampler(model, method, kw, n=1):
    return build_sampler(_method(method), model, Tok(), GenerationConfig(max_new_tokens=n, stop_at_eos=False, **kw))


@pytest.mark.parametrize("method,kw", METHODS)
@torch.no_grad()
def test_rows_joining_and_leaving_between_steps_decode_their_batch1_tokens(rand_model, method, kw):
    """Three slots; requests arrive every other step, each with its own length; finished rows are read and
    reused at once. Sampled rows draw from their own seeded streams, so they too decode their batch-1 tokens."""
    cfgs = [GenerationConfig(max_new_tokens=5 + 2 * (i % 3), stop_at_eos=False, **kw) for i in range(len(PROMPTS))]
    session = _sampler(rand_model, method, kw).session(Canvas.empty(3, 40, PAD))
    waiting, slots, got, step = list(range(len(PROMPTS))), {}, {}, 0
    while waiting or slots:
        if waiting and step % 2 == 0 and len(slots) < 3:
            i = waiting.pop(0)
            b = next(b for b in range(3) if b not in slots)
            session.admit(b, PROMPTS[i], cfgs[i].max_new_tokens)
            slots[b] = i
        calls = session.next_calls()
        if calls:
            session.advance([forward(rand_model, c) for c in calls])
        for b, i in list(slots.items()):
            if bool(session.st.done[b]):
                got[i] = session.output(rows=slice(b, b + 1)).tokens[0]
                del slots[b]
        step += 1
    for i, (p, c) in enumerate(zip(PROMPTS, cfgs)):
        assert got[i] == _alone(rand_model, _method(method), p, c), (method, i)


@pytest.mark.parametrize("method,kw", GREEDY)
@torch.no_grad()
def test_one_busy_row_of_eight_slots_makes_a_one_row_call(rand_model, method, kw):
    session = _sampler(rand_model, method, kw).session(Canvas.empty(8, 40, PAD))
    assert session.next_calls() == []                 # no row has work
    session.admit(5, PROMPTS[0], 6)
    n = 0
    while calls := session.next_calls():
        assert [c.rows for c in calls] == [1]
        session.advance([forward(rand_model, c) for c in calls])
        n += 1
    assert n > 0 and bool(session.st.done[5])


@torch.no_grad()
def test_the_protocol_refuses_misuse(rand_model):
    session = _sampler(rand_model, "setdlm", {"window": 2}, n=4).session(
        Canvas.from_prompts([PROMPTS[0]], MASK, PAD, 4))
    with pytest.raises(RuntimeError, match="without a call"):
        session.advance([None])
    calls = session.next_calls()
    assert session.in_step and session.next_calls() == calls       # asking again hands out the same call
    with pytest.raises(RuntimeError, match="between steps"):
        session.admit(0, PROMPTS[1], 4)
    session.advance([forward(rand_model, c) for c in calls])
    assert not session.in_step


@pytest.mark.parametrize("method,kw", METHODS + [("setdlm+spec", {"window": 4, "speculative": True})])
@torch.no_grad()
def test_every_sampler_and_session_is_of_the_one_family_with_the_typed_state(rand_model, method, kw):
    """decoding/session.py: every sampler a Sampler, every session a Session holding the shared state; the "joins
    between steps" guard is the base's, for every method."""
    model = Spec(rand_model) if method == "setdlm+spec" else rand_model
    sampler = _sampler(model, method, kw, n=4)
    session = sampler.session(Canvas.from_prompts([PROMPTS[0]], MASK, PAD, 4))
    assert isinstance(sampler, Sampler) and isinstance(session, Session) and session.cfg is sampler.cfg
    assert type(session) is {"ar": ARSession, "bd3lm": BD3LMSession, "mdlm": MDLMSession,
                             "setdlm+spec": SpeculativeSession}.get(method, SetDLMSession)
    assert session.st.tokens.shape == session.canvas.tokens.shape
    assert session.budget == kw.get("context_length", getattr(model, "training_length", None))
    assert session.rule == ("leftmost" if method == "setdlm+spec" else "confidence")
    assert session.runner is None if method == "mdlm" else isinstance(session.runner, ChunkRunner)
    calls = session.next_calls()
    with pytest.raises(RuntimeError, match="between steps"):
        session.admit(0, PROMPTS[1], 4)
    session.advance([forward(model, c) for c in calls])
    assert session.output().nfe == 1


@torch.no_grad()
def test_retired_row_stops_at_once_and_its_slot_is_reused(rand_model):
    for method, kw in GREEDY:
        session = _sampler(rand_model, method, kw).session(Canvas.empty(2, 40, PAD))
        session.admit(0, PROMPTS[0], 12)
        calls = session.next_calls()
        session.advance([forward(rand_model, c) for c in calls])
        session.retire(0)
        assert session.next_calls() == [] and bool(session.st.done[0])
        session.admit(0, PROMPTS[2], 6)
        while calls := session.next_calls():
            session.advance([forward(rand_model, c) for c in calls])
        cfg = GenerationConfig(max_new_tokens=6, stop_at_eos=False, **kw)
        assert session.output(rows=slice(0, 1)).tokens[0] == _alone(rand_model, _method(method), PROMPTS[2], cfg)


OWN = [dict(), dict(temperature=0.8, top_p=0.9, seed=5), dict(temperature=1.3, repetition_penalty=1.4, seed=7),
       dict(repetition_penalty=1.2), dict(temperature=0.8, top_p=0.9, seed=11)]


@pytest.mark.parametrize("method,kw", [(m, kw) for m, kw in METHODS if m in ("setdlm", "ar", "bd3lm", "mdlm")])
@torch.no_grad()
def test_rows_with_their_own_sampling_options_share_a_session_and_decode_their_batch1_tokens(rand_model, method,
                                                                                              kw):
    """One session, five rows that differ in temperature, top_p, repetition penalty and seed (the options a serving
    session lets its rows choose, serving/sessions.py): every row decodes what it decodes alone."""
    from setdiff_mega.decoding.sampling import RowOptions

    base = {k: v for k, v in kw.items() if k not in ("temperature", "seed")}
    cfgs = [GenerationConfig(max_new_tokens=6, stop_at_eos=False, **base, **own) for own in OWN]
    session = _sampler(rand_model, method, base).session(Canvas.empty(len(OWN), 40, PAD))
    for b, c in enumerate(cfgs):
        session.admit(b, PROMPTS[b], c.max_new_tokens, c.seed, RowOptions.of(c))
    while not bool(session.st.done.all()):
        session.advance([forward(rand_model, c) for c in session.next_calls()])
    for b, c in enumerate(cfgs):
        assert session.output(rows=slice(b, b + 1)).tokens[0] == _alone(rand_model, _method(method), PROMPTS[b], c), \
            (method, b)
