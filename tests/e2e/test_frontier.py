"""tools/bench_frontier.py end to end at a toy size: models trained once and reused, every sampler setting
measured, CSV / PNG / infill table / summary written."""
import csv
import json

from .conftest import _run


def test_frontier_benchmark_writes_csv_plot_and_infill_table(data_dir, tmp_path):
    out = tmp_path / "frontier"
    args = ["tools/bench_frontier.py", "--out", str(out), "--steps", "6", "--limit", "2", "--taus", "0.5,2.0",
            "--max-new-tokens", "24", "--methods", "ar,bd3lm:block_size=4,setdlm:D=2", "--tasks",
            str(data_dir / "tasks"), "model.num_layers=1", "model.hidden_size=32", "model.num_attention_heads=2",
            f"data.path={data_dir / 'corpus'}", "train.micro_batch_size=4", "train.eval_iters=1",
            "train.warmup_steps=1", "train.log_interval=3"]
    r = _run(args)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    rows = list(csv.DictReader(open(out / "frontier.csv")))
    # AR: one point; BD3LM: one per tau; SetDLM: W in {D, 2D} x tau
    assert [row["tag"] for row in rows].count("ar") == 1
    assert [row["tag"] for row in rows].count("bd3lm_block_size4") == 2
    assert [row["tag"] for row in rows].count("setdlm_D2") == 4
    assert all(float(row["tokens_per_s"]) > 0 and 0 <= float(row["accuracy"]) <= 1 for row in rows)
    sd = {(row["window"], row["tau"]): float(row["tokens_per_step"]) for row in rows if row["tag"] == "setdlm_D2"}
    assert sd[("2", "2.0")] == 1.0                  # tau > 1 commits one token per step
    infill = list(csv.DictReader(open(out / "infill.csv")))
    assert {row["method"]: row["context"] for row in infill} == {
        "AR": "left only", "BD3LM (S=4)": "both sides", "SetDLM (D=2)": "both sides"}
    assert (out / "frontier.png").stat().st_size > 1000
    summary = json.loads((out / "summary.json").read_text())
    assert "bd3lm_best" in summary["summary"]["accuracy"]
    assert "SetDLM at >= that" in r.stdout or "no SetDLM setting reaches it" in r.stdout
    r2 = _run(args)                                 # trained models are reused, not retrained
    assert r2.returncode == 0 and "training" not in r2.stdout
