"""A light client's row share beside a flood (issue 57, setdiff_mega/serving/admission.py): while more than one
client has work no client is given rows beyond its share, a light client's job starts at the next step, a client
alone fills the batch. Deterministic: a scripted clock for the policy, the scheduler's own admissions (not
timings) for the loop."""
import time

import pytest

from setdiff_mega.decoding.base import GenerationConfig
from setdiff_mega.serving.admission import RowShares
from setdiff_mega.serving.bounded import FairQueue
from setdiff_mega.serving.job import Job
from setdiff_mega.serving.scheduler import Scheduler
from tests.serving_helpers import BOS, Tok


def _jobs(client, n, max_new_tokens=6):
    cfg = GenerationConfig(max_new_tokens=max_new_tokens, stop_at_eos=False, window=2, tau=1.5)
    return [Job([BOS, 1, 2], cfg, lambda e, x: None, tokenizer=Tok(), client=client) for _ in range(n)]


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_a_lone_client_fills_the_batch_and_two_clients_share_it():
    shares = RowShares(8)
    q = FairQueue()
    flood = _jobs("flood", 20)
    q.extend(flood)
    taken = shares.take(q, [], 8)
    assert taken == flood[:8]                                       # alone: every row
    light = _jobs("light", 1)[0]
    q.append(light)
    running = flood[:4]                                             # four of the flood's rows ended
    taken = shares.take(q, running, 4)
    assert taken == [light]                                         # the flood holds 4 = ceil(8 / 2): no more
    assert len(q) == 12 and flood[8] in q                           # its excess waits, nothing refused
    taken = shares.take(q, [flood[0], light], 6)
    assert taken == flood[8:11]                                     # up to its share again, one row left free
    assert shares.take(q, [flood[0], light, *flood[8:11]], 3) == []


def test_the_share_is_the_batch_over_the_active_clients_or_the_flag():
    shares = RowShares(8)
    assert [shares.share(n) for n in (0, 1, 2, 3, 8, 20)] == [8, 8, 4, 3, 1, 1]
    q = FairQueue()
    a, b, c = _jobs("a", 8), _jobs("b", 8), _jobs("c", 8)
    for trio in zip(a, b, c):
        q.extend(trio)
    taken = shares.take(q, [], 8)
    assert [sum(j.client == k for j in taken) for k in "abc"] == [3, 3, 2]   # equal turns, each within 3
    fixed = RowShares(8, row_share=6)
    q = FairQueue()
    q.extend(_jobs("flood", 10) + _jobs("light", 1))
    assert sum(j.client == "flood" for j in fixed.take(q, [], 8)) == 6
    for bad in (0, 9):
        with pytest.raises(ValueError, match="--client-row-share must be between 1 and --max-batch"):
            RowShares(8, row_share=bad)


def test_a_client_between_two_requests_keeps_its_share_for_the_linger():
    clock = Clock()
    shares = RowShares(4, linger=0.1, clock=clock)
    q = FairQueue()
    flood = _jobs("flood", 10)
    q.extend(flood)
    shares.left("light")                                            # its request just answered, the next coming
    clock.t = 0.05
    assert shares.take(q, [], 4) == flood[:2]                       # still its share: two rows kept for it
    light = _jobs("light", 1)[0]
    q.append(light)
    assert shares.take(q, flood[:2], 2) == [light]                  # back: a row at once
    shares.left("light")
    clock.t = 0.2                                                   # gone for longer than the linger
    assert shares.take(q, flood[:2], 2) == flood[2:4]               # the flood alone: every row
    assert shares.lingering() == set()                              # the record is dropped: bounded


def test_the_loop_never_gives_a_flood_rows_beyond_its_share_and_admits_a_light_client_at_the_next_step(tiny_model):
    """The scheduler's loop with the tiny model: a flood of long jobs alone fills the batch; a light client's
    closed loop of short requests (each sent as the last ends) is admitted at the very next step each time, and
    no admission gives the flood a row beyond its share while the light client is active; once it has gone,
    the flood fills the batch again."""
    rows = 4
    sch = Scheduler(tiny_model, Tok(), "setdlm", max_batch=rows)
    sch.shares.linger = 600.0                   # the light client's gaps never end its share (no timing in it)
    flood = _jobs("flood", 14, max_new_tokens=40)
    lights = _jobs("light", 3, max_new_tokens=4)
    takes, failures, state = [], [], {"next": 0, "check": None}
    real_take = sch.shares.take

    def take(queue, running, free):
        running = list(running)
        light_active = "light" in {j.client for j in running} | set(queue.waiting()) | sch.shares.lingering()
        out = real_take(queue, running, free)
        held = sum(j.client == "flood" for j in running + out)
        takes.append((light_active, held, any(j.client == "flood" for j in out)))
        return out

    def step_end():                             # the loop's thread, after a step and before the next admission
        try:
            if state["check"] is not None and state["check"].started is None:
                failures.append(f"light job {state['next']} was not admitted at the step after it came")
            state["check"] = None
            i = state["next"]
            if i < len(lights) and (lights[i - 1].done if i else takes):
                sch.submit([lights[i]])
                state["next"], state["check"] = i + 1, lights[i] if i else None   # the first waits for a row
            if lights[-1].done and sch.shares.linger:
                sch.shares.linger = 0.0         # gone: the flood alone again
        except Exception as e:                  # noqa: BLE001 (reported by the test, not swallowed by the loop)
            failures.append(repr(e))
    sch.shares.take = take
    sch.on_step_end = step_end
    sch.submit(flood)
    sch.start()
    try:
        deadline = time.monotonic() + 300
        while not all(j.done for j in flood + lights):
            assert time.monotonic() < deadline and sch._thread.is_alive(), "the jobs did not end"
            time.sleep(0.02)
    finally:
        sch.close()
    assert not failures, failures
    assert takes[0][1] == rows and takes[0][0] is False              # alone: the whole batch
    assert all(j.started is not None and j.tokens for j in lights)
    over = [held for active, held, gained in takes if active and gained and held > rows // 2]
    assert not over, f"the flood was given rows beyond its share ({rows // 2}) while the light client was active"
    after = [held for active, held, gained in takes[1:] if not active and gained]
    assert after and max(after) == rows                             # the light client gone: every row again


def test_the_server_refuses_a_share_outside_the_batch_in_one_line():
    from setdiff_mega.serve import build, parse_args

    args = parse_args(["--checkpoint", "nowhere", "--max-batch", "4", "--client-row-share", "5"])
    with pytest.raises(ValueError, match=r"--client-row-share must be between 1 and --max-batch \(4\), got 5"):
        build(args)                                     # refused before any engine starts
    assert parse_args(["--checkpoint", "nowhere"]).client_row_share is None


def test_the_default_row_share_is_two_rows_on_a_cpu_and_the_ceil_rule_elsewhere():
    from setdiff_mega.serving.admission import CPU_ROW_SHARE, default_row_share

    assert CPU_ROW_SHARE == 2
    assert default_row_share(None, 8, "cpu") == 2 and default_row_share(None, 1, "cpu") == 1
    assert default_row_share(None, 8, "cuda") is None                    # RowShares' ceil(max_batch / clients)
    assert default_row_share(5, 8, "cpu") == 5 and default_row_share(5, 8, "cuda") == 5     # given: as given
