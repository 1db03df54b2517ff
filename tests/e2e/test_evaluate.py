"""tools/evaluate.py and the lm-evaluation-harness adapter on a briefly trained tiny model."""
import json
import random

import pytest

from .conftest import ROOT, TINY, run_here


@pytest.fixture(scope="module", params=["setdlm", "ar"])
def trained(request, data_dir, tmp_path_factory, mcore):
    from setdiff_mega.config import load_config
    from setdiff_mega.training import train

    save = tmp_path_factory.mktemp(f"eval_{request.param}")
    cfg = load_config(ROOT / "configs/tiny_cpu.yaml", [*TINY, "train.train_steps=400", "train.lr=5e-3",
                                                        f"objective.name={request.param}", "objective.D=2",
                                                        f"data.path={data_dir / 'corpus'}", f"train.save_dir={save}",
                                                        "train.eval_interval=0", "model.hidden_size=64"])
    train(cfg, log=lambda *a: None)
    return save, request.param


def _stories(data_dir, n):
    rows = [json.loads(x) for x in (data_dir / "tasks" / "stories.jsonl").read_text().splitlines()[:n]]
    return rows


def test_loglikelihood_ranks_correct_continuations_and_agrees_with_evaluate(trained, data_dir, tmp_path):
    from setdiff_mega.eval.lm_eval_adapter import SetDiffLMCore

    save, objective = trained
    core = SetDiffLMCore(str(save), orders=2)
    rows = _stories(data_dir, 6)
    pairs, corrupted = [], []
    rng = random.Random(0)
    for r in rows:
        ctx, cont = r["sentences"][0], " " + r["sentences"][1]
        words = cont.split()
        rng.shuffle(words)
        pairs.append((ctx, cont))
        corrupted.append((ctx, " " + " ".join(words)))
    good, bad = core.loglikelihood(pairs), core.loglikelihood(corrupted)
    assert all(g[0] > b[0] for g, b in zip(good, bad)), (good, bad)
    assert all(g[0] < 0 for g in good)

    # loglikelihood_rolling == -(tools/evaluate.py --text NLL sum) on the same text
    texts = [" ".join(r["sentences"]) for r in rows[:3]]
    f = tmp_path / "held.jsonl"
    f.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    out = tmp_path / "eval.json"
    r = run_here(["tools/evaluate.py", "--checkpoint", str(save), "--text", str(f), "--no-tasks", "--orders", "2",
              "--out", str(out)])
    assert r.returncode == 0, r.stderr[-2000:]
    lk = json.loads(out.read_text())["likelihood"]
    rolling = core.loglikelihood_rolling(texts)
    assert -sum(rolling) == pytest.approx(lk["nll_sum"], rel=1e-9)
    assert f"{objective} | NLL" in r.stdout


def test_lm_eval_harness_runs_a_local_task(trained, tmp_path):
    """A local multiple-choice task (no downloads) through lm_eval.simple_evaluate."""
    pytest.importorskip("lm_eval")
    import lm_eval
    from lm_eval.tasks import TaskManager

    from setdiff_mega.eval.lm_eval_adapter import SetDiffLM

    save, _ = trained
    docs = [{"context": "Question: Sam has 3 apples. Then she buys 2 more. How many apples does Sam have now?\n"
                        "Answer:", "choices": [" Sam starts with 3 apples.", " zebra quantum lattice"], "label": 0},
            {"context": "Ava was a baker who lived in a small town.", "choices": [" One day", " ### ###"], "label": 0}]
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "tiny_mc.yaml").write_text(f"""task: setdiff_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
""")
    model = SetDiffLM(checkpoint=str(save))
    res = lm_eval.simple_evaluate(model=model, tasks=["setdiff_tiny_mc"],
                                  task_manager=TaskManager(include_path=str(tmp_path / "tasks")))
    acc = res["results"]["setdiff_tiny_mc"]["acc,none"]
    assert 0.0 <= acc <= 1.0
    text = model.core.generate_until([("Question: Sam has 3 apples.\nAnswer:", {"until": ["\n"], "max_gen_toks": 8})])
    assert len(text) == 1 and "\n" not in text[0]


def test_lm_eval_chat_template_path_renders_prompts_as_training_data(trained, tmp_path):
    """lm-eval's --apply_chat_template: the harness's chat history goes through the checkpoint's chat template
    (the adapter's apply_chat_template), and the context tokens are the supervised data's prompt tokens."""
    pytest.importorskip("lm_eval")
    import lm_eval
    from lm_eval.tasks import TaskManager

    from setdiff_mega.data.chat import ChatRenderer
    from setdiff_mega.eval.lm_eval_adapter import SetDiffLM

    from ..unit.test_sft_data import QWEN3_STYLE

    save, objective = trained
    if objective != "setdlm":
        pytest.skip("the chat path does not depend on the objective")
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in
                            [("Sam has 3 apples and buys 2. How many?", "5"), ("What is 4 plus 4?", "8")]))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "tiny_gen.yaml").write_text(f"""task: setdiff_tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["<|im_end|>"]
  max_gen_toks: 6
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
""")
    model = SetDiffLM(checkpoint=str(save), enable_thinking="false")
    model.core.tok.chat_template = QWEN3_STYLE              # as a model fine-tuned on conversations keeps it
    seen, real = [], model.core.generate_until
    model.core.generate_until = lambda reqs: seen.extend(reqs) or real(reqs)
    res = lm_eval.simple_evaluate(model=model, tasks=["setdiff_tiny_gen"], apply_chat_template=True,
                                  task_manager=TaskManager(include_path=str(tmp_path / "tasks")))
    assert "exact_match,none" in res["results"]["setdiff_tiny_gen"] and len(seen) == 2
    renderer = ChatRenderer(model.core.tok, QWEN3_STYLE, {"enable_thinking": False})
    for ctx, _ in seen:
        question = ctx.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
        assert ctx == renderer.render_prompt(question) and ctx.endswith("</think>\n\n")
        assert model.core.context_ids(ctx) == renderer.prompt_ids(question)
    assert model.tokenizer_name.startswith(f"setdiff-{model.core.tok.hash}-")


def test_evaluate_cli_tasks_and_likelihood(trained_run, data_dir, tmp_path):
    save, _ = trained_run
    out = tmp_path / "e.json"
    r = run_here(["tools/evaluate.py", "--checkpoint", str(save), "--limit", "3", "--max-sequences", "8",
              "--max-new-tokens", "12", "--tasks", str(data_dir / "tasks"), "--out", str(out)])
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.loads(out.read_text())
    assert rep["likelihood"]["sequences"] == 8 and rep["likelihood"]["ppl"] > 1
    # L = 32: the math prompts do not fit and are skipped (counted); the short stories are infilled
    assert rep["math"]["n"] + rep["math"]["skipped_too_long"] == 3 and 0 <= rep["math"]["accuracy"] <= 1
    assert rep["infill"]["n"] + rep["infill"]["skipped_too_long"] == 3 and 0 <= rep["infill"]["rouge_l"] <= 1
    assert rep["infill_left_only"]["task"] == "story_infill_left_only"
    assert rep["arith"]["n"] + rep["arith"]["skipped_too_long"] == 3                     # the newer tasks too
    assert rep["quest_infill"]["task"] == "quest_infill" and rep["quest_infill_left_only"]["n"] + \
        rep["quest_infill_left_only"]["skipped_too_long"] == 3
    r = run_here(["tools/evaluate.py", "--checkpoint", str(save), "--no-likelihood", "--chat", "--tasks",
                  str(data_dir / "tasks")])
    assert r.returncode == 2 and "tokenizer has no chat template" in r.stderr and r.stderr.strip().count("\n") == 0
    r = run_here(["tools/evaluate.py", "--checkpoint", str(save), "--text", "/nonexistent.txt", "--no-tasks"])
    assert r.returncode == 2 and "'/nonexistent.txt' does not exist" in r.stderr
    r = run_here(["tools/evaluate.py", "--checkpoint", str(save), "--no-likelihood", "--tasks", str(tmp_path / "none")])
    assert r.returncode == 2 and "run tools/prepare_data.py --embedded first" in r.stderr


def test_evaluate_cli_lookahead(trained_run, tmp_path):
    save, _ = trained_run
    recs = tmp_path / "dev.jsonl"
    recs.write_text("".join(json.dumps({"prompt": p, "response": r}) + "\n" for p, r in
                            [("Once upon a time", " there was"), ("The cat", " sat"), ("A", " b c")]))
    out = tmp_path / "la.json"
    r = run_here(["tools/evaluate.py", "--checkpoint", str(save), "--lookahead", "2", "--records", str(recs),
                  "--limit", "2", "--no-tasks", "--no-likelihood", "--out", str(out)])
    assert r.returncode == 0, r.stderr[-2000:]
    la = json.loads(out.read_text())["lookahead"]
    assert la["K"] == 2 and la["records"] == 2 and la["count"][0] == la["steps"] and la["count"][1] == la["steps"] - 2
    assert all(0 <= a <= 1 for a in la["acc"]) and 0 <= la["mean_run"] <= 2 and "lookahead acc" in r.stdout
    r = run_here(["tools/evaluate.py", "--checkpoint", str(save), "--lookahead", "2", "--no-tasks"])
    assert r.returncode == 2 and "--records FILE go together" in r.stderr and r.stderr.strip().count("\n") == 0
    recs.write_text('{"prompt": "a", "response": "b"}\n{"prompt": 3}\n')
    r = run_here(["tools/evaluate.py", "--checkpoint", str(save), "--lookahead", "2", "--records", str(recs),
                  "--no-tasks", "--no-likelihood"])
    assert r.returncode == 2 and f"{recs}:2: expected a JSON object" in r.stderr
