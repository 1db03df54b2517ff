"""Preprocessing at scale: round trips, worker invariance, input formats, blends, resumable order, errors."""
import json
import shutil

import numpy as np
import pytest

from setdiff_mega.data import DataError, Tokenizer, check_dataset
from setdiff_mega.data.preprocess import preprocess

TEXTS = ["plain ascii document", "", "unicode: héllo wörld, 中文, emoji 😀🚀",
         "\n\nleading and\n\n\ntrailing blank lines\n\n",
         "long " * 5000, "tabs\tand\r\nwindows newlines", "  spaces  ", "final"] * 25


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("pre")
    with open(d / "in.jsonl", "w", encoding="utf-8") as f:
        for i, t in enumerate(TEXTS):
            f.write(json.dumps({"text": t, "title": f"t{i}"}, ensure_ascii=False) + "\n")
    tok = Tokenizer.train(TEXTS, vocab_size=400)
    tok.save(d / "tok.json")
    return d


def _docs(prefix):
    from setdiff_mega.compat import mcore_cpu  # noqa: F401
    # isort: split
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(str(prefix))
    return [ds[i] for i in range(len(ds))], ds


def test_round_trip_mixed_corpus_many_shards(corpus):
    m = preprocess([str(corpus / "in.jsonl")], str(corpus / "out/a"), str(corpus / "tok.json"), workers=2,
                   unit_bytes=4096, progress=False, log=lambda *a: None)
    tok = Tokenizer.from_file(corpus / "tok.json")
    docs, ds = _docs(corpus / "out/a")
    nonempty = [t for t in TEXTS if t]
    assert m["num_documents"] == len(TEXTS) and len(docs) == len(nonempty)
    for text, ids in zip(nonempty, docs):
        assert ids[0] == tok.bos and ids[-1] == tok.eos
        assert tok.decode(ids[1:-1]) == text                   # identical text, in input order
    # an empty document is an empty document (no sequence, no BOS / EOD), as Megatron-LM writes it
    assert np.array_equal(ds.document_indices, np.cumsum([0] + [1 if t else 0 for t in TEXTS]))
    assert ds.index.dtype == np.uint16
    assert check_dataset(corpus / "out/a", tok.vocab_size, verify_hashes=True)["num_tokens"] == m["num_tokens"]


def test_worker_count_does_not_change_the_output(corpus):
    a = preprocess([str(corpus / "in.jsonl")], str(corpus / "w1/c"), str(corpus / "tok.json"), workers=1,
                   unit_bytes=1 << 20, progress=False, log=lambda *a: None)
    b = preprocess([str(corpus / "in.jsonl")], str(corpus / "w2/c"), str(corpus / "tok.json"), workers=2,
                   unit_bytes=3000, progress=False, log=lambda *a: None)
    assert a["sha256"] == b["sha256"]


def test_other_input_formats_give_the_same_documents(corpus):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets import Dataset

    rows = [json.loads(x) for x in (corpus / "in.jsonl").read_text(encoding="utf-8").splitlines()]
    pq.write_table(pa.table({"text": [r["text"] for r in rows]}), corpus / "in.parquet", row_group_size=37)
    Dataset.from_dict({"text": [r["text"] for r in rows]}).save_to_disk(str(corpus / "hf"))
    ref = preprocess([str(corpus / "in.jsonl")], str(corpus / "f/j"), str(corpus / "tok.json"), progress=False,
                     log=lambda *a: None)
    for name, src in (("p", corpus / "in.parquet"), ("h", corpus / "hf")):
        m = preprocess([str(src)], str(corpus / f"f/{name}"), str(corpus / "tok.json"), progress=False,
                       log=lambda *a: None)
        assert m["sha256"]["bin"] == ref["sha256"]["bin"], name
    (corpus / "plain.txt").write_text("first doc\nstill first\n\nsecond doc\n", encoding="utf-8")
    docs, _ = _docs_of(corpus, [str(corpus / "plain.txt")], "t")
    tok = Tokenizer.from_file(corpus / "tok.json")
    assert [tok.decode(d[1:-1]) for d in docs] == ["first doc\nstill first", "second doc"]


def _docs_of(corpus, inputs, name, **kw):
    preprocess(inputs, str(corpus / f"g/{name}"), str(corpus / "tok.json"), progress=False, log=lambda *a: None, **kw)
    return _docs(corpus / f"g/{name}")


def test_several_keys_globs_and_no_bos_eod(corpus):
    shutil.copy(corpus / "in.jsonl", corpus / "in2.jsonl")
    docs, _ = _docs_of(corpus, [str(corpus / "in*.jsonl")], "k", json_keys=["title", "text"], prepend_bos=False,
                       append_eod=False)
    tok = Tokenizer.from_file(corpus / "tok.json")
    assert len(docs) == 2 * len(TEXTS)
    assert tok.decode(docs[2]) == "t2\n" + TEXTS[2]


def test_preprocess_errors_name_file_and_problem(corpus, tmp_path):
    tok = str(corpus / "tok.json")
    with pytest.raises(DataError, match=r"in.jsonl:1: JSON key 'body' does not exist \(keys: text, title\)"):
        preprocess([str(corpus / "in.jsonl")], str(tmp_path / "x"), tok, json_keys=["body"], progress=False)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataError, match="hold no data"):
        preprocess([str(tmp_path / "empty.jsonl")], str(tmp_path / "x"), tok, progress=False)
    (tmp_path / "c.jsonl.gz").write_bytes(b"\x1f\x8b")
    with pytest.raises(DataError, match="is compressed; decompress it first"):
        preprocess([str(tmp_path / "c.jsonl.gz")], str(tmp_path / "x"), tok, progress=False)
    with pytest.raises(DataError, match="matches no file"):
        preprocess([str(tmp_path / "nothing*.jsonl")], str(tmp_path / "x"), tok, progress=False)


def test_undecodable_and_non_string_input_name_the_line_in_the_file(corpus, tmp_path):
    """Issue 16, defects 2 and 3: the line is counted in the whole file (not in the worker's unit), and
    null / numbers / objects are refused instead of written as "None" / "42"."""
    tok = str(corpus / "tok.json")
    good = (corpus / "in.jsonl").read_bytes()
    n = good.count(b"\n")
    for tail, needle in ((b'{"text": "caf\xe9"}\n', rf"bad.jsonl:{n + 1}: not valid UTF-8 \(byte 0xe9 at column 14\)"),
                         (b'{"text": null}\n',
                          rf"bad.jsonl:{n + 1}: the value of 'text' is null; a document must"),
                         (b'{"text": 42}\n', rf"bad.jsonl:{n + 1}: the value of 'text' is int 42"),
                         (b'{"text": ["a", 3]}\n', rf"bad.jsonl:{n + 1}: the value of 'text' is list \['a', 3\]"),
                         (b'["text"]\n', rf"bad.jsonl:{n + 1}: expected a JSON object"),
                         (b'{"text": "x"\n', rf"bad.jsonl:{n + 1}: not valid JSON")):
        (tmp_path / "bad.jsonl").write_bytes(good + tail)
        for workers, unit in ((1, 1 << 20), (2, 3000)):        # one unit, or many: the same line number
            with pytest.raises(DataError, match=needle):
                preprocess([str(tmp_path / "bad.jsonl")], str(tmp_path / "x"), tok, workers=workers,
                           unit_bytes=unit, progress=False)
    (tmp_path / "bad.txt").write_bytes(b"fine\n\nalso fine\nbut caf\xe9 here\n")
    with pytest.raises(DataError, match=r"bad.txt:4: not valid UTF-8 \(byte 0xe9 at column 8\)"):
        preprocess([str(tmp_path / "bad.txt")], str(tmp_path / "x"), tok, progress=False)
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"text": ["a", None, "c"]}), tmp_path / "bad.parquet")
    with pytest.raises(DataError, match=r"bad.parquet \(row group 0, row 1\): the value of 'text' is null"):
        preprocess([str(tmp_path / "bad.parquet")], str(tmp_path / "x"), tok, progress=False)
    assert not (tmp_path / "x.bin").exists()


def test_lists_are_sentences_and_empty_documents_stay_empty_like_megatron(corpus, tmp_path):
    """Issue 16, defects 3 and 4: a list value is one document of sentences (one sequence each, empty ones
    dropped, EOD on the last); an empty document has no tokens and no sequence (Megatron-LM's layout)."""
    tokp = str(corpus / "tok.json")
    tok = Tokenizer.from_file(tokp)
    rows = [{"text": ["first sentence.", "", " second one."]}, {"text": ""}, {"text": []}, {"text": "plain"}]
    (tmp_path / "s.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    m = preprocess([str(tmp_path / "s.jsonl")], str(tmp_path / "s"), tokp, prepend_bos=False, progress=False,
                   log=lambda *a: None)
    docs, ds = _docs(tmp_path / "s")
    a, b, c = tok.encode("first sentence."), tok.encode(" second one."), tok.encode("plain")
    assert [list(d) for d in docs] == [a, b + [tok.eos], c + [tok.eos]]
    assert list(ds.document_indices) == [0, 2, 2, 2, 3] and m["num_documents"] == 4
    assert m["num_tokens"] == len(a) + len(b) + len(c) + 2


def test_interrupted_run_keeps_the_previous_dataset(corpus, tmp_path):
    tok = str(corpus / "tok.json")
    good = preprocess([str(corpus / "in.jsonl")], str(tmp_path / "d"), tok, progress=False, log=lambda *a: None)
    bad = tmp_path / "bad.jsonl"
    bad.write_text((corpus / "in.jsonl").read_text(encoding="utf-8") + "{not json\n", encoding="utf-8")
    with pytest.raises(DataError, match="not valid JSON"):
        preprocess([str(bad)], str(tmp_path / "d"), tok, workers=2, unit_bytes=2000, progress=False, overwrite=True)
    assert check_dataset(tmp_path / "d", verify_hashes=True)["manifest"]["sha256"] == good["sha256"]
    assert not list(tmp_path.glob("d.tmp-*"))


def test_corrupt_index_and_manifest_mismatch(corpus, tmp_path):
    tok = str(corpus / "tok.json")
    preprocess([str(corpus / "in.jsonl")], str(tmp_path / "d"), tok, progress=False, log=lambda *a: None)
    shutil.copy(tmp_path / "d.idx", tmp_path / "orig.idx")
    raw = bytearray((tmp_path / "d.idx").read_bytes())
    raw[9] = 7                                                 # version 7
    (tmp_path / "d.idx").write_bytes(bytes(raw))
    with pytest.raises(DataError, match=r"index file '.*d.idx' has version 7"):
        check_dataset(tmp_path / "d")
    raw[:9] = b"XXXXXXXXX"                                     # wrong magic
    (tmp_path / "d.idx").write_bytes(bytes(raw))
    with pytest.raises(DataError, match=r"does not start with megatron-core's index header"):
        check_dataset(tmp_path / "d")
    shutil.copy(tmp_path / "orig.idx", tmp_path / "d.idx")
    with open(tmp_path / "d.bin", "r+b") as f:                 # same size, different content
        f.seek(10)
        f.write(b"\x01\x00")
    with pytest.raises(DataError, match=r"'.*d.bin' does not match the SHA-256 in its manifest"):
        check_dataset(tmp_path / "d", verify_hashes=True)


def test_adopt_an_existing_tokenizer(tmp_path):
    from tokenizers import Tokenizer as HF
    from tokenizers import decoders, models, pre_tokenizers, trainers

    hf = HF(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf.save(str(tmp_path / "gpt2like.json"))
    with pytest.raises(ValueError, match="lacks the special tokens"):
        Tokenizer.from_file(tmp_path / "gpt2like.json")
    tok = Tokenizer.adopt(tmp_path / "gpt2like.json", bos="<|endoftext|>", eos="<|endoftext|>")
    assert tok.bos == tok.eos == tok.pad == 0 and tok.mask == hf.get_vocab_size()
    tok.save(tmp_path / "out" / "tokenizer.json")
    again = Tokenizer.from_file(tmp_path / "out" / "tokenizer.json")
    assert again.special_ids == tok.special_ids
    assert again.encode("a <|mask|> b").count(again.mask) == 1


def test_blend_weights_seeds_and_resume(corpus, mcore, tmp_path):
    from setdiff_mega.data.loader import batches, build_splits

    tok = Tokenizer.from_file(corpus / "tok.json")
    for name, n in (("a", 400), ("b", 400)):
        with open(tmp_path / f"{name}.jsonl", "w") as f:
            for i in range(n):
                f.write(json.dumps({"text": f"{name} document {i} " + "word " * (i % 50)}) + "\n")
        preprocess([str(tmp_path / f"{name}.jsonl")], str(tmp_path / name), str(corpus / "tok.json"), progress=False,
                   log=lambda *a: None)
    blend = f"0.3 {tmp_path / 'a'} 0.7 {tmp_path / 'b'}"
    train, _, _ = build_splits(blend, tok, 16, "98,1,1", 5, (10000, 10, 10), str(tmp_path / "cache"))
    frac = np.bincount(np.asarray(train.dataset_index[:10000]), minlength=2) / 10000
    assert abs(frac[0] - 0.3) < 0.01 and abs(frac[1] - 0.7) < 0.01
    again, _, _ = build_splits(blend, tok, 16, "98,1,1", 5, (10000, 10, 10), str(tmp_path / "cache2"))
    assert all(np.array_equal(train[i]["tokens"], again[i]["tokens"]) for i in range(0, 10000, 997))
    other, _, _ = build_splits(blend, tok, 16, "98,1,1", 6, (10000, 10, 10), str(tmp_path / "cache3"))
    assert not all(np.array_equal(train[i]["tokens"], other[i]["tokens"]) for i in range(0, 200, 7))
    # resuming from a number of consumed samples continues exactly
    full = batches(train, 4, 0)
    seq = [next(full).tokens for _ in range(6)]
    resumed = batches(train, 4, 3 * 4)
    assert all(np.array_equal(seq[3 + k], next(resumed).tokens) for k in range(3))


def test_fast_encoder_is_exact_and_falls_back(corpus):
    from setdiff_mega.data.corpus import embedded_corpus
    from setdiff_mega.data.fast_encode import FastEncoder

    tok = Tokenizer.from_file(corpus / "tok.json")
    enc = FastEncoder(tok, verify_every=0)
    assert enc.enabled
    texts = TEXTS + [d["text"] for d in embedded_corpus(200, 200, seed=3)] + [
        "it's we're they'll I'd   multiple   spaces\t\ttabs\n\n\nend ", "ctrl\x0bchar", "<|eos|> inside text",
        "digits 12345 and 3.14, punctuation!?;", "naïve café", "x" * 3000]
    for t in texts:
        assert enc.encode(t) == tok.hf.encode(t, add_special_tokens=False).ids, repr(t[:40])
    assert enc.fast_docs > 0 and enc.slow_docs > 0          # unicode / control chars / specials fell back

    from tokenizers import normalizers
    tok.hf.normalizer = normalizers.Lowercase()              # a pipeline the fast path does not model
    assert not FastEncoder(tok).enabled


def test_other_invocations_staging_dirs_are_left_alone(corpus, tmp_path):
    """Leftovers of interrupted runs (even under this process's own pid) were not created by this invocation:
    they survive it untouched, and this run stages in a fresh directory it removes itself."""
    import os

    dead = tmp_path / "d.tmp-999999999-0"
    mine = tmp_path / f"d.tmp-{os.getpid()}-0"                # same pid, an earlier invocation's leftover
    for d in (dead, mine):
        d.mkdir()
        (d / "keep.txt").write_text("not yours")
    preprocess([str(corpus / "in.jsonl")], str(tmp_path / "d"), str(corpus / "tok.json"), progress=False,
               log=lambda *a: None)
    assert (dead / "keep.txt").read_text() == "not yours" and (mine / "keep.txt").read_text() == "not yours"
    assert sorted(p.name for p in tmp_path.glob("d.tmp-*")) == sorted([dead.name, mine.name])
    assert (tmp_path / "d.bin").exists() and (tmp_path / "d.idx").exists()
