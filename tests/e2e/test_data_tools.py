"""The data CLIs end to end: train_tokenizer, preprocess_data (sharded + merge), inspect_data."""
import json

from .conftest import _run


def test_tokenizer_preprocess_shards_merge_inspect(tmp_path):
    rows = [{"text": f"document {i}: " + "some words here. " * (i % 7) + ("émoji 😀" if i % 5 == 0 else "")}
            for i in range(3000)]
    (tmp_path / "raw.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows),
                                        encoding="utf-8")
    r = _run(["tools/train_tokenizer.py", "--input", str(tmp_path / "raw.jsonl"), "--vocab-size", "400",
              "--out", str(tmp_path / "tok")])
    assert r.returncode == 0, r.stderr
    tok = str(tmp_path / "tok" / "tokenizer.json")
    common = ["--tokenizer", tok, "--unit-mb", "0.02", "--no-progress"]
    r = _run(["tools/preprocess_data.py", "--input", str(tmp_path / "raw.jsonl"), "--output-prefix",
              str(tmp_path / "one/c"), *common])
    assert r.returncode == 0, r.stderr
    for i in range(2):
        r = _run(["tools/preprocess_data.py", "--input", str(tmp_path / "raw.jsonl"), "--shard", f"{i}/2",
                  "--output-prefix", str(tmp_path / f"part{i}/c"), *common])
        assert r.returncode == 0, r.stderr
    r = _run(["tools/preprocess_data.py", "--merge", str(tmp_path / "part0/c"), str(tmp_path / "part1/c"),
              "--output-prefix", str(tmp_path / "merged/c")])
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "merged/c.bin").read_bytes() == (tmp_path / "one/c.bin").read_bytes()
    assert (tmp_path / "merged/c.idx").read_bytes() == (tmp_path / "one/c.idx").read_bytes()
    r = _run(["tools/inspect_data.py", str(tmp_path / "merged/c"), "--tokenizer", tok, "--docs", "1"])
    assert r.returncode == 0, r.stderr
    assert '"documents": 3000' in r.stdout and "document 0:" in r.stdout and '"hashes_verified": true' in r.stdout
    with open(tmp_path / "one/c.bin", "r+b") as f:
        f.truncate(100)
    r = _run(["tools/inspect_data.py", str(tmp_path / "one/c"), "--tokenizer", tok])
    assert r.returncode == 2 and "is truncated" in r.stderr and "Traceback" not in r.stderr
    r = _run(["tools/preprocess_data.py", "--input", str(tmp_path / "raw.jsonl"), "--json-keys", "body",
              "--output-prefix", str(tmp_path / "x/c"), "--tokenizer", tok])
    assert r.returncode == 2 and "JSON key 'body' does not exist" in r.stderr and "Traceback" not in r.stderr
