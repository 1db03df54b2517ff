"""The engine's side of the pipe (setdiff_mega/serving/engine_process.py), driven message by message without its
process: jobs submitted, cancelled and refused each end with exactly one event that names them, answers carry their
question's id, and a job decoded through the running engine sends its events keyed by the HTTP side's key."""
import threading
import time

from setdiff_mega.decoding.base import GenerationConfig
from setdiff_mega.serving.engine_process import EngineCore
from setdiff_mega.serving.messages import Answer, Ask, Cancel, Close, Events, JobSpec, Submit
from setdiff_mega.serving.metrics import Metrics
from setdiff_mega.serving.scheduler import Scheduler

from .test_serving_batching import BOS, Tok


class Pipe:
    """The engine's end of the pipe: what it sends, and the HTTP side's messages it receives, in order."""

    def __init__(self, incoming=()):
        self.sent, self.incoming = [], list(incoming)

    def send(self, message):
        self.sent.append(message)

    def recv(self):
        while not self.incoming:
            time.sleep(0.001)
        return self.incoming.pop(0)


def _events(pipe, key):
    return [(e, p) for m in pipe.sent if isinstance(m, Events) for k, e, p in m.events if k == key]


def _spec(key, n=3):
    return JobSpec(key, [BOS, 1, 2], GenerationConfig(max_new_tokens=n, window=2, tau=0.5), arrival=time.monotonic())


def test_submit_cancel_ask_and_refusals_each_answer_once(rand_model):
    metrics = Metrics()
    sch = Scheduler(rand_model, Tok(), "setdlm", max_batch=2, max_queue=2, metrics=metrics)
    pipe = Pipe()
    core = EngineCore(sch, pipe, metrics)
    assert core.handle(Submit([_spec(7), _spec(8)]))
    assert [j.key for j in sch.queue] == [7, 8] and set(core.jobs) == {7, 8}
    core.handle(Ask(41, "health"))
    answer = pipe.sent[-1]
    assert isinstance(answer, Answer) and answer.ask_id == 41
    assert {k: answer.value[k] for k in ("running", "queued")} == {"running": 0, "queued": 2}
    assert "loop_alive" in answer.value       # the pulse's vital signs beside the counts
    core.handle(Cancel(8, "cancelled"))           # queued: dropped, its end sent at once (not the loop's thread)
    assert [j.key for j in sch.queue] == [7] and _events(pipe, 8)[-1][0] == "done" and 8 not in core.jobs
    core.handle(Cancel(99, "cancelled"))          # an unknown key (already ended): nothing
    core.handle(Submit([_spec(9), _spec(10)]))    # over the engine's own bound: each fails alone, 429
    assert [e for e, _ in _events(pipe, 9)] == ["error"] and _events(pipe, 9)[0][1][0] == 429
    core.handle(Ask(42, "metrics"))
    assert pipe.sent[-1] == Answer(42, pipe.sent[-1].value) and b"setdiff_queue_length" in pipe.sent[-1].value
    assert b"setdiff_requests_total" not in pipe.sent[-1].value        # the HTTP process's counter, not the engine's
    sch.close()
    core.handle(Submit([_spec(11)]))              # shutting down: 503
    assert _events(pipe, 11) == [("error", (503, "the server is shutting down"))]
    assert not core.handle(Close())


def test_the_running_engine_decodes_and_sends_its_events_by_key(rand_model):
    metrics = Metrics()
    sch = Scheduler(rand_model, Tok(), "setdlm", max_batch=2, metrics=metrics)
    pipe = Pipe([Submit([_spec(3, n=4)])])
    core = EngineCore(sch, pipe, metrics)
    deadline = time.monotonic() + 30
    t = threading.Thread(target=core.run, daemon=True)
    t.start()
    while not any(e == "done" for e, _ in _events(pipe, 3)):
        assert time.monotonic() < deadline
        time.sleep(0.005)
    pipe.incoming.append(Close())
    t.join(timeout=10)
    assert not t.is_alive() and not sch._thread.is_alive()
    done = _events(pipe, 3)[-1][1]
    assert done["finish_reason"] in ("stop", "length") and len(done["token_ids"]) <= 4
    assert "".join(p for e, p in _events(pipe, 3) if e == "delta") == done["text"]
