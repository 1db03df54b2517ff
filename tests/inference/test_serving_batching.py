"""Step-level continuous batching (setdiff_mega/serving): fused forwards equal separate ones, and every sampler
decodes the same tokens through the scheduler as alone, whatever joins or leaves the batch mid-decode."""
import threading
import time
from dataclasses import replace

import pytest
import torch

from setdiff_mega.decoding.base import Canvas, GenerationConfig
from setdiff_mega.decoding.cache import KVCache
from setdiff_mega.decoding.calls import Call, fused_forward
from setdiff_mega.inference.api import build_sampler
from setdiff_mega.serving.execution import Execution
from setdiff_mega.serving.job import Job
from setdiff_mega.serving.messages import QueueFull
from setdiff_mega.serving.scheduler import Scheduler
from tests.serving_helpers import BOS, EOS, MASK, PAD, Tok

PROMPTS = [[BOS, 1, 2, 3, 4, 5], [BOS, 9], [BOS, 11, 12], [BOS, 1, 2, MASK, MASK, MASK, MASK, 7, 8, EOS],
           [BOS, 20, 21, 22, 23, 24, 25, 26, 27], [BOS, 3, MASK, MASK, MASK, 4, EOS], [BOS, 30]]
METHODS = [("setdlm", {"window": 4, "tau": 0.5}), ("setdlm", {"window": 2, "tau": 1.5}),
           ("setdlm+fht", {"window": 4, "tau": 0.5, "fht_cache_order": True, "context_length": 12}),
           ("setdlm+sampled", {"window": 4, "tau": 0.5, "temperature": 1.0, "seed": 3}),
           ("ar", {}), ("bd3lm", {"block_size": 4, "tau": 0.5}), ("mdlm", {"block_size": 4, "tau": 0.5})]


def _method(name):
    """A method name, or the SetDLM objective itself (its order prior: FHT cache order)."""
    from setdiff_mega.diffusion import SetDLMObjective

    return SetDLMObjective(MASK, D=4) if name == "setdlm+fht" else name.split("+")[0]


def _alone(model, method, ids, cfg):
    out = build_sampler(method, model, Tok(), cfg).generate(Canvas.from_prompts([ids], MASK, PAD, cfg.max_new_tokens))
    return out.tokens[0]


@torch.no_grad()
def test_fused_forward_equals_each_call_alone(rand_model):
    """Calls with caches of different lengths and chunks of different widths and logits starts."""
    layers, groups, d = rand_model.cache_shape()
    calls, alone = [], []
    for b, (cached, T, start) in enumerate([(3, 5, 2), (0, 4, 4), (7, 2, 0)]):
        cache = KVCache(layers, 1, groups, d, 16)
        if cached:                                    # fill the cache with a causal prefill
            tok = torch.randint(0, 57, (1, cached))
            keep = torch.ones(1, cached, cached, dtype=torch.bool).tril()
            with rand_model.use_cache(cache):
                rand_model(tok, torch.arange(cached)[None], torch.cat([torch.zeros(1, cached, 16, dtype=torch.bool),
                                                                       keep], -1), cached)
            cache.commit(torch.tensor([cached]))
        tok = torch.randint(0, 57, (1, T))
        pos = cached + torch.arange(T)[None]
        keep = torch.cat([cache.valid()[:, None, :].expand(1, T, 16), torch.ones(1, T, T, dtype=torch.bool).tril()], -1)
        calls.append(Call(tok, pos, keep, start, cache))
        with rand_model.use_cache(cache):
            alone.append(rand_model(tok, pos, keep, start))
        cache.discard()
    fused = fused_forward(rand_model, calls, PAD)
    for a, f in zip(alone, fused):
        assert f.shape == a.shape
        torch.testing.assert_close(f, a, atol=1e-5, rtol=1e-5)


def _serve(model, method, cfgs, prompts, max_batch, stagger: float = 0.0, min_saving=None):
    sch = Scheduler(model, Tok(), method, max_batch=max_batch, min_saving=min_saving).start()
    events = {}
    lock = threading.Lock()

    def emitter(i):
        def emit(ev, payload):
            with lock:
                events.setdefault(i, []).append((ev, payload))
        return emit
    jobs = [Job(p, c, emitter(i), tokenizer=Tok()) for i, (p, c) in enumerate(zip(prompts, cfgs))]
    try:
        for j in jobs:                                # arrivals spread over the decode: joins mid-batch
            sch.submit([j])
            time.sleep(stagger)
        deadline = time.monotonic() + 120
        while not all(j.done for j in jobs):
            assert time.monotonic() < deadline, "the scheduler got stuck"
            time.sleep(0.005)
    finally:
        sch.close()
    return jobs, events, sch


@pytest.mark.parametrize("cut", [False, True], ids=["default", "prefills-apart"])
@pytest.mark.parametrize("method,kw", METHODS)
def test_every_sampler_decodes_the_same_tokens_in_a_continuous_batch(rand_model, method, kw, cut, monkeypatch):
    """Different max_new_tokens make jobs leave at different steps; staggered arrivals make others join. Jobs of
    equal options share a session (slot rows reused as jobs leave); sampled ones too, each row drawing from its
    own seeded stream. ``prefills-apart``: every joining row's prefill that leaves padding runs in a forward of
    its own (serving/fusion.py, ``min_saving=1``), and the tokens are the same."""
    import setdiff_mega.serving.forwards as forwards

    cuts = []
    real = forwards.split_rows
    monkeypatch.setattr(forwards, "split_rows", lambda call, m: cuts.append(len(out := real(call, m)) - 1) or out)
    method = _method(method)
    cfgs = [GenerationConfig(max_new_tokens=6 + 3 * (i % 3), stop_at_eos=False, **kw) for i in range(len(PROMPTS))]
    jobs, events, sch = _serve(rand_model, method, cfgs, PROMPTS, max_batch=3, stagger=0.003,
                               min_saving=1 if cut else None)
    if cut and method not in ("mdlm",):                   # MDLM decodes uncached: nothing to cut
        assert sum(cuts) > 0
    for i, (job, p, c) in enumerate(zip(jobs, PROMPTS, cfgs)):
        done = [x for ev, x in events[i] if ev == "done"]
        assert done, events[i]
        assert done[0]["token_ids"] == _alone(rand_model, method, p, c), (method, i)
        streamed = "".join(x for ev, x in events[i] if ev == "delta")
        assert streamed == done[0]["text"] == Tok().decode(done[0]["token_ids"])
    assert sch.steps < sum(len(_alone(rand_model, method, p, c)) + 1 for p, c in zip(PROMPTS, cfgs))


def test_stop_string_ends_a_job_early_and_is_excluded(rand_model):
    cfg = GenerationConfig(max_new_tokens=12, window=2, tau=1.5, stop_at_eos=False)
    full = Tok().decode(_alone(rand_model, "setdlm", PROMPTS[0], cfg))
    stop = full[5:7]
    job = Job(PROMPTS[0], cfg, lambda *a: None, stops=(stop,), tokenizer=Tok())
    sch = Scheduler(rand_model, Tok(), "setdlm", max_batch=2).start()
    try:
        sch.submit([job])
        while not job.done:
            time.sleep(0.005)
    finally:
        sch.close()
    assert job.reason == "stop" and job.text == full[:full.index(stop)]
    assert stop not in job.text


def test_cancel_queue_full_and_a_failing_job_leave_the_others_intact(rand_model):
    cfg = GenerationConfig(max_new_tokens=40, window=2, tau=1.5, stop_at_eos=False)
    sch = Scheduler(rand_model, Tok(), "setdlm", max_batch=2, max_queue=3).start()
    try:
        long = Job(PROMPTS[1], cfg, lambda *a: None, tokenizer=Tok())
        bad = Job([BOS, *range(1, 12)], GenerationConfig(max_new_tokens=4, context_length=4), lambda *a: None,
                  tokenizer=Tok())            # a prompt longer than its context: the job fails alone
        errors = []
        bad.emit = lambda ev, payload: errors.append(payload) if ev == "error" else None
        ok = Job(PROMPTS[2], GenerationConfig(max_new_tokens=6, stop_at_eos=False), lambda *a: None, tokenizer=Tok())
        sch.submit([long, bad, ok])
        with pytest.raises(QueueFull):
            sch.submit([Job(PROMPTS[0], cfg, lambda *a: None, tokenizer=Tok()) for _ in range(2)])
        while not long.tokens:
            time.sleep(0.002)
        sch.cancel(long)
        deadline = time.monotonic() + 60
        while not (long.done and bad.done and ok.done):
            assert time.monotonic() < deadline
            time.sleep(0.005)
        assert long.reason == "cancelled" and len(long.tokens) < 40
        assert errors and errors[0][0] == 400 and "context" in errors[0][1]
        assert ok.tokens == _alone(rand_model, "setdlm", PROMPTS[2], ok.config)
        time.sleep(0.1)
        assert sch.idle
    finally:
        sch.close()


def test_jobs_that_differ_in_sampling_options_share_one_decode(rand_model):
    """temperature, top_p, min_p, repetition penalty and seed are each row's own: five such jobs make one shared decode
    (one session key), and each decodes what it decodes alone."""
    from setdiff_mega.serving.sessions import session_key

    own = [dict(), dict(temperature=0.8, top_p=0.9, seed=5), dict(temperature=1.3, repetition_penalty=1.4, seed=7),
           dict(repetition_penalty=1.2), dict(temperature=0.8, top_p=0.9, min_p=0.05, seed=11)]
    cfgs = [GenerationConfig(max_new_tokens=6, stop_at_eos=False, window=4, tau=0.5, **o) for o in own]
    assert len({session_key(c) for c in cfgs}) == 1
    assert session_key(replace(cfgs[0], tau=0.7)) != session_key(cfgs[0])
    jobs, events, sch = _serve(rand_model, "setdlm", cfgs, PROMPTS[:5], max_batch=5)
    for i, (p, c) in enumerate(zip(PROMPTS, cfgs)):
        done = [x for ev, x in events[i] if ev == "done"]
        assert done and done[0]["token_ids"] == _alone(rand_model, "setdlm", p, c), i
    assert sch.steps < sum(len(_alone(rand_model, "setdlm", p, c)) for p, c in zip(PROMPTS, cfgs))


def test_shared_decodes_are_as_wide_as_their_requests_need(rand_model, monkeypatch):
    """A shared decode's canvas is the smallest power of two >= 64 holding prompt + max_tokens (at most the
    server's width): a short request never pays a step's bookkeeping over the longest one the server admits. Jobs
    of one session key in two widths decode in two decodes, fused in one forward, each what it decodes alone."""
    sch = Scheduler(rand_model, Tok(), "setdlm", max_batch=4, width=256)
    size = lambda n, new: sch._bucket(Job([BOS] * n, GenerationConfig(max_new_tokens=new), None, tokenizer=Tok()))  # noqa: E731
    assert (size(10, 6), size(40, 24), size(40, 25), size(100, 100), size(300, 8)) == (64, 64, 128, 256, 256)
    cfgs = [GenerationConfig(max_new_tokens=n, stop_at_eos=False, window=4, tau=0.5) for n in (6, 70, 8, 80)]
    widths = []
    real = Execution._decode

    def spy(self, job, key, solo=False):
        d = real(self, job, key, solo)
        widths.append(d.session.canvas.tokens.shape[1])
        return d
    monkeypatch.setattr(Execution, "_decode", spy)
    jobs, events, _ = _serve(rand_model, "setdlm", cfgs, PROMPTS[:4], max_batch=4)
    assert sorted(set(widths)) == [64, 128]
    for i, (p, c) in enumerate(zip(PROMPTS, cfgs)):
        done = [x for ev, x in events[i] if ev == "done"]
        assert done and done[0]["token_ids"] == _alone(rand_model, "setdlm", p, c), i


def test_a_shared_decode_left_without_jobs_is_reused_and_the_resting_ones_are_bounded(rand_model, monkeypatch):
    """One request at a time: every request after the first decodes in the first one's decode (its KV cache is
    not allocated again); requests of other options each rest a decode, the newest IDLE_DECODES of them."""
    import setdiff_mega.serving.execution as execution
    import setdiff_mega.serving.kvbudget as kvbudget

    made = []

    class Counted(execution.Decode):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            made.append(self)
    monkeypatch.setattr(execution, "Decode", Counted)
    monkeypatch.setattr(kvbudget, "IDLE_DECODES", 2)
    base = GenerationConfig(max_new_tokens=5, stop_at_eos=False, window=4, tau=0.5)
    sch = Scheduler(rand_model, Tok(), "setdlm", max_batch=2).start()
    try:
        for i, p in enumerate(PROMPTS[:3] + PROMPTS[:3]):
            cfg = base if i < 3 else replace(base, tau=(0.6, 0.7, 0.8)[i - 3])    # other options: other decodes
            job = Job(p, cfg, lambda e, x: None, tokenizer=Tok())
            sch.submit([job])
            deadline = time.monotonic() + 60
            while not job.done:
                assert time.monotonic() < deadline
                time.sleep(0.002)
            assert job.tokens == _alone(rand_model, "setdlm", p, cfg)
            time.sleep(0.02)                                   # the loop sweeps the finished job
        mine = [d for d in made if d.shared]
        assert len(mine) == 1 + 3                              # the first options' decode served all three
        assert len(sch.resting) == len(sch.shared) == 2 and not sch.decodes     # the oldest two were let go
    finally:
        sch.close()


def test_a_job_alone_decodes_in_a_one_row_decode_and_later_ones_share_a_full_one(rand_model, monkeypatch):
    """A job alone takes a one-row shared decode (one request at a time costs a step what ``generate`` at batch 1
    costs); jobs that come while it runs share a ``max_batch``-row decode, fused with it in one forward (attention
    per decode through its own cache: calls.RowCaches), and every job decodes what it decodes alone."""
    import setdiff_mega.serving.execution as execution
    import setdiff_mega.serving.forwards as forwards

    made, fused = [], []

    class Counted(execution.Decode):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            made.append(self)

    def counted(model, calls, pad):
        fused.append(len(calls))
        return real(model, calls, pad)
    real = forwards.fused_forward
    monkeypatch.setattr(execution, "Decode", Counted)
    monkeypatch.setattr(forwards, "fused_forward", counted)
    first = GenerationConfig(max_new_tokens=40, stop_at_eos=False, window=4, tau=1.5)     # one token per step
    later = replace(first, max_new_tokens=6)
    sch = Scheduler(rand_model, Tok(), "setdlm", max_batch=4).start()
    try:
        jobs = [Job(PROMPTS[0], first, lambda e, x: None, tokenizer=Tok())]
        sch.submit(jobs)
        deadline = time.monotonic() + 60
        while not jobs[0].tokens and not jobs[0].done:        # admitted and decoding
            assert time.monotonic() < deadline
            time.sleep(0.001)
        jobs += [Job(p, later, lambda e, x: None, tokenizer=Tok()) for p in PROMPTS[1:4]]
        sch.submit(jobs[1:])
        while not all(j.done for j in jobs):
            assert time.monotonic() < deadline
            time.sleep(0.005)
    finally:
        sch.close()
    assert [d.rows for d in made] == [1, 4]
    assert 2 in fused                                         # the two decodes' calls in one forward
    for j, p in zip(jobs, PROMPTS):
        assert j.tokens == _alone(rand_model, "setdlm", p, j.config)


@pytest.mark.parametrize("due", [True, False])
def test_a_streams_text_is_found_when_it_would_go_out_and_none_is_lost(rand_model, due):
    """``stream_due`` (the server's outbox: more text of a started stream goes out every --stream-interval): when
    it says no, a job's new text waits (only its first text goes at once) and its end hands over the rest; the
    deltas always add up to the whole text."""
    cfg = GenerationConfig(max_new_tokens=24, stop_at_eos=False, window=4, tau=1.5)
    sch = Scheduler(rand_model, Tok(), "setdlm", max_batch=2)
    sch.stream_due = lambda: due
    sch.start()
    events = []
    job = Job(PROMPTS[0], cfg, lambda e, x: events.append((e, x)), tokenizer=Tok())
    try:
        sch.submit([job])
        deadline = time.monotonic() + 60
        while not job.done:
            assert time.monotonic() < deadline
            time.sleep(0.002)
    finally:
        sch.close()
    deltas = [x for e, x in events if e == "delta"]
    done = [x for e, x in events if e == "done"][0]
    assert "".join(deltas) == done["text"] and len(done["text"]) == 24
    assert done["token_ids"] == _alone(rand_model, "setdlm", PROMPTS[0], cfg)
    assert len(deltas) > 2 if due else len(deltas) == 2        # the first text, then the rest at the end
