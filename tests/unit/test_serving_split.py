"""The scheduler split (issue 58): typed pipe messages in one module both processes share, the HTTP process never
importing the scheduler, one KV-cache budget over every decode, and no serving class over 250 lines."""
import ast
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from setdiff_mega.serving import kvbudget
from setdiff_mega.serving.kvbudget import KVBudget
from setdiff_mega.serving.messages import Answer, Events, Fatal, JobSpec, NeverFits, QueueFull, Ready, Submit

ROOT = Path(__file__).resolve().parents[2]


class FakeDecode:
    def __init__(self, rows, width, room=True):
        self.rows, self.width, self.room = rows, width, room

    def has_room(self):
        return self.room


def test_the_messages_cross_a_pipe_as_the_same_types():
    for m in (Submit([JobSpec(3, [1, 2], None, ("x",), 5.0, False, 1.5, "key0")]), Events([(3, "delta", "hi")]),
              Answer(7, {"running": 1}), Fatal(True, "no checkpoint"), Ready({"max_batch": 8})):
        back = pickle.loads(pickle.dumps(m))
        assert type(back) is type(m) and back == m
    assert issubclass(QueueFull, Exception) and "8 jobs" in str(NeverFits(8, 4, 12))


def test_the_http_process_never_imports_the_scheduler_for_its_messages():
    code = ("import sys; import setdiff_mega.serving.app, setdiff_mega.serving.client, setdiff_mega.serving.messages; "
            "print(sorted(m for m in sys.modules if m.startswith('setdiff_mega.serving.')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    loaded = out.stdout
    for engine_side in ("scheduler", "execution", "admission", "kvbudget", "engine_process", "sessions"):
        assert f"setdiff_mega.serving.{engine_side}'" not in loaded, f"the HTTP side imports {engine_side}: {loaded}"


def test_the_kv_budget_keeps_resting_decodes_within_the_idle_cap_and_its_positions(monkeypatch):
    monkeypatch.setattr(kvbudget, "IDLE_DECODES", 3)
    budget = KVBudget(positions=8 * 64 * 3)
    live = [FakeDecode(8, 64)]
    rest = [FakeDecode(8, 64) for _ in range(3)]
    for i, d in enumerate(rest):
        budget.register(("opts", i), d)
    assert budget.find(("opts", 0)) is rest[0] and budget.find(("none", 0)) is None
    for d in rest:
        assert budget.rest(d, live)
    assert budget.resting == rest[1:] and budget.held(live) == 8 * 64 * 3     # the oldest let go: positions
    assert not budget.registered(rest[0]) and budget.find(("opts", 0)) is None
    budget.positions = None
    extra = [FakeDecode(1, 64) for _ in range(3)]
    for i, d in enumerate(extra):
        budget.register(("more", i), d)
        budget.rest(d, live)
    assert budget.resting == extra and len(budget.shared) == 3                 # the idle cap alone
    budget.wake(extra[0])
    assert extra[0] not in budget.resting and budget.registered(extra[0])
    assert not budget.rest(FakeDecode(1, 64), live)                             # unregistered: not kept
    full = FakeDecode(8, 64, room=False)
    budget.register(("full", 0), full)
    assert budget.find(("full", 0)) is None                                    # a full one is replaced by the caller
    with pytest.raises(ValueError, match="positions >= 1"):
        KVBudget(0)


def test_no_serving_class_is_over_250_lines():
    over = []
    for f in sorted((ROOT / "setdiff_mega" / "serving").glob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 250:
                over.append(f"{f.name}:{node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert not over, over
