"""tools/bench_train_gpu.py runs end to end on a CPU with the tiny preset (the GPU numbers come from
scripts/gpu_check.sh): every setting either reports numbers or says why it cannot run here."""
import csv
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_train_cpu_smoke(mcore, tmp_path):
    sys.path.insert(0, str(ROOT / "tools"))
    import bench_train_gpu

    out = tmp_path / "bench"
    rc = bench_train_gpu.main(["--device", "cpu", "--preset", "tiny", "--seq-lengths", "16", "--tokens-per-step",
                               "128", "--warmup", "1", "--iters", "1", "--out-dir", str(out)])
    assert rc == 0
    rows = {r["label"]: r for r in csv.DictReader(open(out / "bench_train.csv"))}
    for label in ("ar/sdpa-causal", "setdlm/sdpa-dense-mask", "setdlm/setcausal", "setdlm/setcausal+fp8"):
        assert rows[label]["error"] == "" and float(rows[label]["step_s"]) > 0, rows[label]
    assert int(rows["ar/sdpa-causal"]["processed_tokens"]) == 8 * 15          # same processed tokens per step
    assert int(rows["setdlm/setcausal"]["processed_tokens"]) == 4 * 32
    assert "no backward on CPU" in rows["setdlm/flex"]["error"]
    attn = {r["backend"]: r for r in csv.DictReader(open(out / "bench_attention.csv"))}
    assert float(attn["two_causal"]["ratio_vs_two_causal"]) == 1.0
    assert float(attn["setcausal"]["fwd_bwd_ms"]) > 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["fastest_setdlm"]["objective"] == "setdlm" and "16" in summary["setcausal_vs_two_causal"]
    assert (out / "mfu.png").stat().st_size > 0
