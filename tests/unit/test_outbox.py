"""The scheduler -> HTTP event hand-over (setdiff_mega/serving/outbox.py): the scheduler thread's events wait for
the end of its step and go over in one ``send``; other threads' go at once; waiting deltas merge per choice without
reordering any choice's events."""
import threading
import time

from setdiff_mega.serving.outbox import Outbox, coalesce


def test_coalesce_merges_each_choices_waiting_deltas_and_keeps_its_order():
    events = [(0, "delta", "a"), (1, "delta", "x"), (0, "delta", "b"), (0, "trace", {"s": 1}), (0, "delta", "c"),
              (1, "delta", "y"), (1, "done", {"r": 1}), (0, "delta", "d")]
    assert coalesce(events) == [(0, "delta", "ab"), (1, "delta", "xy"), (0, "trace", {"s": 1}), (0, "delta", "cd"),
                                (1, "done", {"r": 1})]
    # per choice, the text and the order of its events are what they were
    for i in (0, 1):
        mine = [e for e in events if e[0] == i]
        merged = [e for e in coalesce(events) if e[0] == i]
        assert "".join(p for _, k, p in mine if k == "delta") == "".join(p for _, k, p in merged if k == "delta")
        assert [k for _, k, _ in merged if k != "delta"] == [k for _, k, _ in mine if k != "delta"]
    assert coalesce([]) == []


def test_the_producers_events_wait_for_flush_and_go_in_one_send():
    producer = threading.current_thread()
    sent = []
    box = Outbox(sent.append, lambda: threading.current_thread() is producer)
    e0, e1 = box.emitter(10), box.emitter(11)
    e0("delta", "he")
    e1("delta", "x")
    e0("delta", "llo")
    assert not sent and len(box.pending) == 3                        # held until the step ends
    box.flush()
    assert sent == [[(10, "delta", "he"), (11, "delta", "x"), (10, "delta", "llo")]] and not box.pending
    box.flush()                                                      # nothing pending: nothing sent
    assert len(sent) == 1
    other = threading.Thread(target=e1, args=("error", (500, "x")))  # another thread: at once
    other.start()
    other.join()
    assert sent[-1] == [(11, "error", (500, "x"))] and not box.pending


def test_a_gone_receiver_drops_events_without_raising():
    def send(batch):
        raise BrokenPipeError("the HTTP process is gone")
    box = Outbox(send, lambda: False)
    box.emitter(0)("delta", "x")
    producing = Outbox(send, lambda: True)
    producing.emitter(0)("done", {})
    producing.flush()
    assert not producing.pending


def test_more_text_of_a_started_stream_waits_for_the_interval_but_first_text_and_ends_do_not():
    sent = []
    box = Outbox(sent.append, lambda: True, interval=3600.0)
    emit = box.emitter(0)
    emit("delta", "a")                       # the first text: goes at the next flush
    box.flush()
    assert sent.pop() == [(0, "delta", "a")]
    emit("delta", "b")
    emit("delta", "c")
    box.flush()                              # only more text, within the interval: held
    assert not sent and len(box.pending) == 2
    emit("done", {"finish_reason": "length"})
    box.flush()                              # the end takes what waited with it, in order
    assert sent.pop() == [(0, "delta", "b"), (0, "delta", "c"), (0, "done", {"finish_reason": "length"})]
    other = box.emitter(1)
    box.interval = 0.0                       # 0: every flush hands over
    other("delta", "x")
    box.flush()
    other("delta", "y")
    box.flush()
    assert [b[0][2] for b in sent] == ["x", "y"]


def test_more_text_waits_longer_with_many_jobs_in_flight_and_every_end_is_counted():
    """``rate``: with n jobs in flight, more text of started streams waits at least n / rate seconds (and at least
    ``interval``); a job's end (done or error, from any thread) leaves the count; first texts and ends go at once."""
    producer = threading.current_thread()
    sent = []
    box = Outbox(sent.append, lambda: threading.current_thread() is producer, interval=0.01, rate=100.0)
    emit = [box.emitter(i) for i in range(8)]
    assert box.active == 0 and box.period() == 0.01     # a job counts from its first event (a 429 never does)
    for e in emit:
        e("delta", "a")                      # first texts: urgent
    assert box.active == 8 and abs(box.period() - 0.08) < 1e-9
    box.flush()
    assert len(sent) == 1 and len(sent[0]) == 8 and not box.due()
    emit[0]("delta", "b")                    # more text of a started stream: waits for the period
    box.flush()
    assert box.pending
    time.sleep(0.09)
    assert box.due()
    box.flush()
    assert not box.pending
    for e in emit[:7]:
        e("done", {})
    emit[7]("error", (500, "x"))
    emit[7]("done", {})                      # an end counts once
    assert box.active == 0 and box.period() == 0.01
    box.emitter(9)("error", (400, "bad"))   # ends with its first event: never counted after
    assert box.active == 0
    unbounded = Outbox(sent.append, lambda: True, interval=0.01)
    unbounded.emitter(0)("delta", "a")
    assert unbounded.period() == 0.01
