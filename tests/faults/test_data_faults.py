"""Bad data is refused with one line naming the file and the fix (issue 16, defects 1 and 5)."""
import shutil

import numpy as np
import pytest

from .conftest import TINY, one_line_error, run_tool


def test_training_on_data_made_with_another_tokenizer_is_refused_before_any_work(two_tokenizers, tmp_path):
    d, a, b = two_tokenizers
    save = tmp_path / "run"
    r = run_tool(["pretrain/pretrain.py", "--config", "configs/tiny_cpu.yaml", *TINY, "train.train_steps=2",
                  f"data.path={d / 'corpus'}", f"data.tokenizer={d / 'other_tokenizer.json'}",
                  f"train.save_dir={save}"])
    one_line_error(r, f"'{d / 'corpus'}' was tokenized with tokenizer {a.hash}", f"is tokenizer {b.hash}",
                   "set data.tokenizer to the tokenizer.json the data was made with")
    assert not save.exists()                                   # nothing was written


def test_evaluation_paths_refuse_the_mismatch_too(two_tokenizers, mcore):
    from setdiff_mega.data.indexed import DataError, check_dataset
    from setdiff_mega.data.loader import build_splits

    d, a, b = two_tokenizers
    with pytest.raises(DataError, match=f"tokenized with tokenizer {a.hash}"):
        build_splits(str(d / "corpus"), b, 32, "90,5,5", 1, (8, 8, 8), str(d / "cache"))   # likelihood, sweeps
    assert check_dataset(d / "corpus", a.vocab_size, tokenizer=a)["manifest"] is not None        # its own: fine
    assert check_dataset(d / "corpus", a.vocab_size)["num_documents"] == 1200                    # check off


def test_data_without_manifest_holding_the_mask_id_is_refused(two_tokenizers, tmp_path):
    from setdiff_mega.data.indexed import DataError, check_dataset

    d, a, b = two_tokenizers
    for ext in ("bin", "idx"):                               # as Megatron-LM writes it: no manifest
        shutil.copy(d / f"corpus.{ext}", tmp_path / f"mega.{ext}")
    assert check_dataset(tmp_path / "mega", a.vocab_size, tokenizer=a)["manifest"] is None
    tokens = np.memmap(tmp_path / "mega.bin", dtype=np.uint16, mode="r+")
    tokens[5] = a.mask
    tokens.flush()
    del tokens
    with pytest.raises(DataError, match=f"contains token id {a.mask}, the MASK token"):
        check_dataset(tmp_path / "mega", a.vocab_size, tokenizer=a)


@pytest.mark.parametrize("damage, needle, cli", [
    (lambda b: b"XXIDIDX\x00\x00" + b[9:], "does not start with megatron-core's index header", True),
    (lambda b: b[:20], "is truncated inside its header", False),
    (lambda b: b[:-8], "is truncated or corrupt", False),
    (lambda b: b[:9] + (2).to_bytes(8, "little") + b[17:], "has version 2", False),
])
def test_a_damaged_index_is_one_line_without_a_library_traceback(two_tokenizers, tmp_path, damage, needle, cli):
    """Every damage is named by the header check (in process); the CLIs, which run that check before
    megatron-core sees the file, are run for the first one (each CLI start costs seconds)."""
    from setdiff_mega.data.indexed import DataError, check_dataset

    d, a, _ = two_tokenizers
    shutil.copy(d / "corpus.bin", tmp_path / "corpus.bin")
    shutil.copy(d / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "corpus.idx").write_bytes(damage((d / "corpus.idx").read_bytes()))
    with pytest.raises(DataError, match="regenerate the dataset") as e:
        check_dataset(tmp_path / "corpus", a.vocab_size)
    assert f"index file '{tmp_path / 'corpus'}.idx'" in str(e.value) and needle in str(e.value)
    if not cli:
        return
    r = run_tool(["pretrain/pretrain.py", "--config", "configs/tiny_cpu.yaml", *TINY, "train.train_steps=2",
                  f"data.path={tmp_path / 'corpus'}", f"train.save_dir={tmp_path / 'run'}"])
    one_line_error(r, f"index file '{tmp_path / 'corpus'}.idx'", needle, "regenerate the dataset")
    r = run_tool(["tools/inspect_data.py", str(tmp_path / "corpus")])
    assert r.returncode != 0 and "Traceback" not in r.stderr and needle in r.stderr, r.stderr[-2000:]


def test_preprocess_cli_reports_bad_input_in_one_line_and_keeps_the_old_dataset(two_tokenizers, tmp_path):
    d, a, _ = two_tokenizers
    good = tmp_path / "good.jsonl"
    good.write_text("".join(f'{{"text": "doc {i}"}}\n' for i in range(2000)))
    out = tmp_path / "out" / "c"
    args = ["tools/preprocess_data.py", "--tokenizer", str(d / "tokenizer.json"), "--output-prefix", str(out),
            "--workers", "2", "--unit-mb", "0.01"]
    r = run_tool([*args, "--input", str(good)])
    assert r.returncode == 0, r.stderr[-2000:]
    before = (tmp_path / "out" / "c.bin").read_bytes()
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(good.read_bytes() + b'{"text": null}\n')
    args.append("--overwrite")            # replacing one's own dataset on purpose: the bad record stops it first
    r = run_tool([*args, "--input", str(bad)])
    one_line_error(r, f"{bad}:2001: the value of 'text' is null")
    bad.write_bytes(good.read_bytes() + b'{"text": "caf\xe9"}\n')
    r = run_tool([*args, "--input", str(bad)])
    one_line_error(r, f"{bad}:2001: not valid UTF-8 (byte 0xe9 at column 14)", "re-encode the file as UTF-8")
    assert (tmp_path / "out" / "c.bin").read_bytes() == before          # the previous dataset is intact
