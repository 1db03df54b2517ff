"""tools/visualize_decode.py end to end (issue 40): a trained run at two settings side by side writes the PNG,
the GIF (one frame per step of the longest decode), the page and the traces, whose replay is the text the
tool printed; saved traces redraw; bad input ends in one line."""
import json

from PIL import Image

from setdiff_mega.decoding.trace import DecodeTrace

from .conftest import run_here


def test_visualize_two_settings_side_by_side_and_redraw_from_the_traces(trained_run, tmp_path):
    run, _ = trained_run
    out = tmp_path / "viz"
    r = run_here(["tools/visualize_decode.py", "--checkpoint", run, "--prompt", "Question: what is", "--compare",
                  "tau=1e6,window=4", "--compare", "tau=0.5,window=4", "--max-new-tokens", "12", "--no-eos-stop",
                  "--out", out])
    assert r.returncode == 0, r.stderr
    data = json.loads((out / "traces.json").read_text())
    assert [d["label"] for d in data] == ["tau=1e6,window=4", "tau=0.5,window=4"]
    traces = [DecodeTrace(**d["trace"]) for d in data]
    assert all(len(t.tokens) == 12 for t in traces)
    assert traces[0].num_steps == 12 and traces[1].num_steps <= 12          # tau 1e6: one token per step
    for t in traces:
        assert t.replay()[-1] == t.tokens
    gif = Image.open(out / "decode.gif")
    assert gif.n_frames == max(t.num_steps for t in traces)
    assert Image.open(out / "decode.png").size[0] > 100 and "trace-data" in (out / "decode.html").read_text()
    again = run_here(["tools/visualize_decode.py", "--trace", out / "traces.json", "--out", tmp_path / "again"])
    assert again.returncode == 0, again.stderr
    assert json.loads((tmp_path / "again" / "traces.json").read_text()) == data
    assert (tmp_path / "again" / "decode.png").read_bytes() == (out / "decode.png").read_bytes()


def test_visualize_refuses_bad_settings_and_foreign_directories_in_one_line(trained_run, tmp_path):
    run, _ = trained_run
    r = run_here(["tools/visualize_decode.py", "--checkpoint", run, "--prompt", "x", "--compare", "taux=1",
                  "--out", tmp_path / "a"])
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("error: --compare 'taux=1'")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    r = run_here(["tools/visualize_decode.py", "--checkpoint", run, "--prompt", "x", "--out", tmp_path / "mine"])
    assert r.returncode == 2 and "did not write" in r.stderr and (tmp_path / "mine" / "notes.txt").read_text() == "keep"
    bad = tmp_path / "bad.json"
    bad.write_text('[{"label": "x", "trace": {"method": "ar"}}]')
    r = run_here(["tools/visualize_decode.py", "--trace", bad, "--out", tmp_path / "b"])
    assert r.returncode == 2 and "not a decoding trace" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "b").exists()                     # nothing written for a failed invocation
