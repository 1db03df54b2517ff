"""The generated tasks (setdiff_mega/tasks, issues 55 and 56): generators deterministic by seed, knobs that set
difficulty, verifiers that score validity (alternative answers accepted, wrong ones refused), splits held out by
computation (no dev / test key, group, answer or solution in training text), the grid layout's token positions and
``tools/prepare_data.py --task`` end to end."""
import importlib.util
import json
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from setdiff_mega import tasks
from setdiff_mega.data.chat import ChatRenderer
from setdiff_mega.data.tokenizer import Tokenizer
from setdiff_mega.tasks import countdown, sudoku
from setdiff_mega.tasks.base import Problem, TaskError

ROOT = Path(__file__).resolve().parents[2]
KNOBS = {"sudoku4": {"givens": 6}, "sudoku9": {"givens": 40}, "countdown": {"operands": 4},
         "multiplication": {"digits": 3}, "pathstar": {"degree": 3, "length": 5}, "arithmetic": {"steps": 3},
         "addition": {"digits": 4}}


def _draw(name, knob, n, seed=0):
    task, rng = tasks.get(name), random.Random(seed)
    out = [task.generate(task.knob(knob), rng) for _ in range(n)]
    return [p for p in out if p is not None]


def test_the_package_is_pure_python():
    code = ("import sys, setdiff_mega.tasks\n"
            "print(sorted(m for m in ('torch', 'megatron', 'numpy') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stderr[-2000:]


@pytest.mark.parametrize("name", list(KNOBS))
def test_generators_are_deterministic_by_seed_and_answer_their_own_problems(name):
    task = tasks.get(name)
    a, b, c = _draw(name, KNOBS[name], 12, 0), _draw(name, KNOBS[name], 12, 0), _draw(name, KNOBS[name], 12, 1)
    assert [p.to_dict() for p in a] == [p.to_dict() for p in b] and len(a) == 12
    assert [p.key for p in a] != [p.key for p in c]
    for p in a:
        assert Problem.from_dict(json.loads(json.dumps(p.to_dict()))) == p
        for fmt in tasks.FORMATS:
            rec = task.record(p, fmt)
            assert task.verify(p, rec["response"]), (fmt, rec)
        lay = task.layout(p.knob)
        if task.fixed_length:
            assert lay == (len(task.grid_prompt(p)), len(task.grid_answer(p)))


def test_sudoku_puzzles_are_uniquely_solvable_at_exactly_the_knobs_givens_and_fewer_givens_are_harder():
    for name, g in (("sudoku4", 4), ("sudoku4", 10), ("sudoku9", 30), ("sudoku9", 50)):
        for p in _draw(name, {"givens": g}, 4):
            cells, n = [int(ch) for ch in p.question["puzzle"]], p.question["size"]
            assert sum(v > 0 for v in cells) == g
            assert sudoku.solve(cells, n, limit=2) == [[int(ch) for ch in p.answer]]

    def guesses(g):
        stats = {}
        for p in _draw("sudoku9", {"givens": g}, 6):
            sudoku.solve([int(ch) for ch in p.question["puzzle"]], 9, limit=2, stats=stats)
        return stats.get("guesses", 0)
    assert guesses(26) > guesses(36) >= guesses(50) == 0


def test_the_other_knobs_set_size_and_range():
    for d in (2, 4):
        for p in _draw("multiplication", {"digits": d}, 20):
            assert len(str(p.question["a"])) == len(str(p.question["b"])) == d
            assert len(tasks.get("multiplication").grid_answer(p)) == 2 * d
    for d in (2, 6):                                # addition: the sum always one digit longer than each operand
        for p in _draw("addition", {"digits": d}, 50):
            a, b = p.question["a"], p.question["b"]
            assert len(str(a)) == len(str(b)) == d and len(p.answer) == d + 1 and int(p.answer) == a + b
            assert tasks.get("addition").verify(p, f"{a} + {b} = {a + b}") and not tasks.get("addition").verify(
                p, str(a + b + 1))
    for n, hi in ((3, 50), (5, 1000)):
        for p in _draw("countdown", {"operands": n, "target_min": 10, "target_max": hi}, 20):
            assert len(p.question["operands"]) == n and 10 <= p.question["target"] <= hi
    for d, m in ((2, 3), (5, 8)):
        for p in _draw("pathstar", {"degree": d, "length": m}, 10):
            assert len(p.question["edges"]) == d * (m - 1) and len(p.answer) == m
    for s in (1, 4, 7):
        for p in _draw("arithmetic", {"steps": s}, 20):
            assert p.extra["solution"].count(" = ") == s
    with pytest.raises(TaskError, match="givens"):
        tasks.get("sudoku9").knob({"givens": 3})
    with pytest.raises(TaskError, match="no knob"):
        tasks.get("sudoku9").knob({"digits": 3})
    with pytest.raises(TaskError, match="letters"):
        tasks.get("pathstar").knob({"degree": 10, "length": 8})
    assert tasks.parse_knobs(["operands=5", "target_min=10,target_max=999"]) == {
        "operands": 5, "target_min": 10, "target_max": 999}


def test_countdown_verifier_accepts_every_valid_expression_and_evaluates_without_eval():
    t = tasks.get("countdown")
    p = Problem("countdown", t.knob({"operands": 3}), {"operands": [2, 3, 4], "target": 14}, "2+3*4", "2,3,4=14",
                "2,3,4=14")
    for good in ["2+3*4", "4*3+2", "(3*4)+2", "2*(3+4)", "(4+3)*2", " 2 + 3 * 4 ", "2+3*4____", "2+3*4 = 14",
                 "((2))+3*4"]:
        assert t.verify(p, good), good
    for bad in ["2+3+4", "3*4+2+2", "3*4", "2*7", "-2+4*4", "2+3*4+0", "14", "", "2+3*4)", "(2+3*4",
                "__import__('os').system('true')", "2+3**4", "2 3 4", "2+3*4.0", "x"]:
        assert not t.verify(p, bad), bad
    assert not countdown.check("4/(3-3)+2", [4, 3, 3, 2], 2)                 # division by zero: invalid
    assert countdown.check("3/2*4+8", [3, 2, 4, 8], 14)                      # exact rationals: 3/2*4 = 6
    assert countdown.check("(" * 110 + "1" + ")" * 110 + "+2", [1, 2], 3) is False    # over 200 characters
    assert countdown.show(countdown.parse("8-(4-2)")) == "8-(4-2)"
    assert countdown.show(countdown.parse("(8-4)-2")) == "8-4-2"


def test_sudoku_verifier_checks_validity_against_the_givens_not_the_reference():
    t = tasks.get("sudoku4")
    puzzle = [1, 0, 0, 0] + [0] * 12                      # many solutions
    sols = sudoku.solve(puzzle, 4, limit=2)
    assert len(sols) == 2 and sols[0] != sols[1]
    p = Problem("sudoku4", {"givens": 1}, {"size": 4, "puzzle": "".join(map(str, puzzle))},
                "".join(map(str, sols[0])), "k", "g")
    for s in sols:
        assert t.verify(p, "".join(map(str, s))) and t.verify(p, "\n".join(t.rows("".join(map(str, s)))))
    wrong = list(sols[0])
    wrong[1], wrong[2] = wrong[2], wrong[1]              # a row still a permutation, columns broken
    other = [4, 3, 2, 1, 2, 1, 4, 3, 3, 4, 1, 2, 1, 2, 3, 4]   # valid grid, but the given 1 is not at cell 0
    assert sudoku.is_solution(other, 4)
    for bad in ["".join(map(str, wrong)), "".join(map(str, other)), "".join(map(str, sols[0]))[:-1], ""]:
        assert not t.verify(p, bad)


def test_the_short_answer_verifiers():
    m, a, ps = tasks.get("multiplication"), tasks.get("arithmetic"), tasks.get("pathstar")
    p = Problem("multiplication", {"digits": 3, "digits_b": 0}, {"a": 123, "b": 456}, "56088", "123*456", "56088")
    assert all(m.verify(p, s) for s in ["56088", "056088", "56,088", "#### 56088", "It is 56088."])
    assert not any(m.verify(p, s) for s in ["56089", "", "#### 1", "560880"])
    q = _draw("arithmetic", {"steps": 2}, 1)[0]
    assert a.verify(q, f"whatever\n#### {q.answer}") and not a.verify(q, f"#### {int(q.answer) + 1}")
    g = _draw("pathstar", {"degree": 3, "length": 4}, 1)[0]
    assert ps.verify(g, g.answer) and ps.verify(g, " ".join(g.answer)) and not ps.verify(g, g.answer[:-1])
    other_leaf = next(e[1] for e in g.question["edges"] if e[1] not in g.answer and
                      not any(x[0] == e[1] for x in g.question["edges"]))
    assert not ps.verify(g, g.answer[:-1] + other_leaf)


def _whole_in(s, text):
    lead = r"(?<![0-9A-Za-z])" if s[0].isalnum() else ""
    tail = r"(?![0-9A-Za-z])" if s[-1].isalnum() else ""
    return re.search(lead + re.escape(s) + tail, text) is not None


@pytest.mark.parametrize("name", list(KNOBS))
def test_splits_hold_out_by_computation_and_no_test_answer_is_in_training_text(name):
    task = tasks.get(name)
    knob = dict(KNOBS[name], **({"givens": 45} if name == "sudoku9" else {}))
    sizes = {"train": 300, "dev": 40, "test": 40} if name != "sudoku9" else {"train": 60, "dev": 12, "test": 12}
    probs, report = tasks.build_splits(name, knob, 0, sizes, log=lambda *a: None)
    assert [len(probs[s]) for s in ("train", "dev", "test")] == [sizes[s] for s in ("train", "dev", "test")]
    for split, ps in probs.items():
        assert len({p.key for p in ps}) == len(ps)                        # distinct computations
        assert all(tasks.split_of(name, p.group) == split for p in ps)
    train_keys, train_groups = {p.key for p in probs["train"]}, {p.group for p in probs["train"]}
    for fmt in tasks.FORMATS:
        recs = {s: [task.record(p, fmt) for p in ps] for s, ps in probs.items()}
        assert tasks.check_heldout(recs)["leaks"] == 0
        text = "\n".join(r["prompt"] + "\n" + r["response"] for r in recs["train"])
        for r in recs["test"] + recs["dev"]:
            assert r["key"] not in train_keys and r["group"] not in train_groups
            assert not _whole_in(r["response"], text)
            if task.answer_checked:
                assert not _whole_in(r["answer"], text)
    again, _ = tasks.build_splits(name, knob, 0, {**sizes, "train": 10}, log=lambda *a: None)
    assert [p.key for p in again["test"]] == [p.key for p in probs["test"]]    # test does not move with train size


def test_the_check_finds_a_leak_and_the_assignment_is_a_fixed_function_of_the_group():
    probs, _ = tasks.build_splits("multiplication", {"digits": 3}, 0, {"train": 100, "dev": 10, "test": 10},
                                  log=lambda *a: None)
    t = tasks.get("multiplication")
    recs = {s: [t.record(p, "chat") for p in ps] for s, ps in probs.items()}
    leaked = dict(recs, train=recs["train"] + [recs["test"][0]])
    with pytest.raises(TaskError, match="both the train and the test"):
        tasks.check_heldout(leaked)
    sneaky = dict(recs["train"][0], prompt=f"Note: {recs['test'][3]['answer']} is big.")     # the answer, not the key
    with pytest.raises(TaskError, match="occurs in the training data"):
        tasks.check_heldout(dict(recs, train=recs["train"] + [sneaky]))
    inside = dict(recs["train"][0], prompt=f"Note: 9{recs['test'][3]['answer']}1 is another number.")
    tasks.check_heldout(dict(recs, train=recs["train"][1:] + [inside]))            # not as a whole token: fine
    counts = {"train": 0, "dev": 0, "test": 0}
    for i in range(20000):
        counts[tasks.split_of("multiplication", str(i))] += 1
    assert all(abs(counts[s] / 20000 - f) < 0.01 for s, f in (("test", 0.1), ("dev", 0.1), ("train", 0.8)))
    assert tasks.split_of("multiplication", "56088") == tasks.split_of("multiplication", "56088")
    small, report = tasks.build_splits("multiplication", {"digits": 2}, 0, {"train": 5000, "dev": 600, "test": 0},
                                       log=lambda *a: None)
    assert report["splits"]["train"]["exhausted"] and 3000 < len(small["train"]) < 5000     # ~4,000 in all


def test_drawing_in_worker_processes_gives_the_same_problems():
    one, _ = tasks.build_splits("countdown", {"operands": 3}, 7, {"train": 150, "dev": 20, "test": 20}, workers=1,
                                log=lambda *a: None)
    two, _ = tasks.build_splits("countdown", {"operands": 3}, 7, {"train": 150, "dev": 20, "test": 20}, workers=2,
                                log=lambda *a: None)
    dicts = lambda splits: {s: [p.to_dict() for p in v] for s, v in splits.items()}
    assert dicts(one) == dicts(two)


def test_grid_layout_tokens_are_cells_and_the_answer_starts_where_the_layout_says():
    tok = Tokenizer.characters(tasks.CHARACTERS, (tasks.SEP,))
    assert tok.vocab_size == 4 + 1 + len(tasks.CHARACTERS)
    render = ChatRenderer(tok, None)          # what tools/preprocess_data.py --sft does without a chat template
    for name in ("sudoku4", "sudoku9", "countdown", "multiplication", "pathstar", "addition"):
        task = tasks.get(name)
        knob = task.knob(dict(KNOBS[name], **({"givens": 50} if name == "sudoku9" else {})))
        p = _draw(name, knob, 1)[0]
        rec = task.record(p, "grid")
        ids, mask = render.encode(rec, lambda: "test")
        prompt_chars, answer_chars = task.layout(knob)
        start = prompt_chars + 2
        assert len(ids) == prompt_chars + answer_chars + 3 and ids[0] == tok.bos and ids[-1] == tok.eos
        assert ids[start - 1] == tok.hf.token_to_id(tasks.SEP)
        assert mask.tolist() == [0] * start + [1] * (answer_chars + 1)
        assert tok.decode(ids[1:start - 1]) == task.grid_prompt(p) and tok.decode(ids[start:-1]) == rec["response"]
        if name.startswith("sudoku"):
            assert ids[1:start - 1].tolist() == [tok.hf.token_to_id(ch) for ch in p.question["puzzle"]]
    text = "".join(tasks.CHARACTERS) + tasks.SEP + "x"
    assert tok.decode(tok.encode(text)) == text and len(tok.encode(text)) == len(tasks.CHARACTERS) + 2


def _prepare_data():
    spec = importlib.util.spec_from_file_location("prepare_data", ROOT / "tools" / "prepare_data.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_prepare_data_task_writes_checked_splits_and_supervised_data(tmp_path, capsys):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    tool, out = _prepare_data(), tmp_path / "mult"
    argv = ["--task", "multiplication", "--knob", "digits=2", "--out", str(out), "--num-train", "200", "--num-dev",
            "30", "--num-test", "30", "--workers", "1"]
    assert tool.main(argv) == 0
    assert "12 tokens per document" in capsys.readouterr().out      # 2 x 2 digits: [BOS] 5 [SEP] 4 [EOS]
    rec = json.loads((out / "task.json").read_text())
    assert rec["layout"] == {"prompt_chars": 5, "answer_chars": 4, "document_tokens": 12, "answer_start": 7}
    assert rec["report"]["check"]["leaks"] == 0 and rec["num_documents"] == 200
    splits = {s: [json.loads(x) for x in (out / f"{s}.jsonl").read_text().splitlines()] for s in tasks.splits.SPLITS}
    assert [len(v) for v in splits.values()] == [200, 30, 30]
    tok = Tokenizer.from_file(out / "tokenizer.json")
    docs, targets = IndexedDataset(str(out / "corpus")), IndexedDataset(str(out / "corpus.target"))
    assert len(docs) == 200 and all(len(docs[i]) == 12 for i in range(len(docs)))
    first = splits["train"][0]
    assert tok.decode(docs[0]) == f"<|bos|>{first['prompt']}{first['response']}<|eos|>"
    assert targets[0].tolist() == [0] * 7 + [1] * 5
    assert tool.main([*argv, "--skip-existing"]) == 0 and "skipping" in capsys.readouterr().out
    with pytest.raises(ValueError, match="--tokenizer"):
        tool.main(["--task", "arithmetic", "--format", "chat", "--out", str(tmp_path / "chat")])
