"""Embedded corpus, tokenizer and indexed datasets (round trips through megatron-core's reader)."""
import json
import re

import numpy as np
import pytest

from setdiff_mega.data import DataError, Tokenizer, check_dataset, embedded_corpus, read_documents, write_indexed


@pytest.fixture(scope="module")
def corpus():
    return embedded_corpus(300, 300, seed=7)


@pytest.fixture(scope="module")
def tokenizer(corpus):
    return Tokenizer.train([d["text"] for d in corpus], vocab_size=400)


def test_corpus_is_deterministic_and_mixed(corpus):
    again = embedded_corpus(300, 300, seed=7)
    assert [d["text"] for d in again] == [d["text"] for d in corpus]
    assert {d["task"] for d in corpus} == {"math", "story", "arith", "quest"}
    # version 1's math and story documents are unchanged by the new tasks (same draws in the same order)
    old = [d["text"] for d in embedded_corpus(300, 300, seed=7, num_arith=0, num_quests=0)]
    assert sorted(old) == sorted(d["text"] for d in corpus if d["task"] in ("math", "story"))
    assert embedded_corpus(5, 5, seed=8)[0]["text"] != embedded_corpus(5, 5, seed=7)[0]["text"]


def test_math_solutions_are_correct(corpus):
    for d in (d for d in corpus if d["task"] in ("math", "arith")):
        value = None
        for a, op, b, res in re.findall(r"(\d+) ([-+*/]) (\d+) = (\d+)", d["solution"]):
            a, b, res = int(a), int(b), int(res)
            assert value is None or a == value                # each step continues from the last
            assert res == {"+": a + b, "-": a - b, "*": a * b, "/": a // b}[op]
            assert op != "/" or a % b == 0
            value = res
        assert d["text"].endswith(f"#### {d['answer']}") and int(d["answer"]) == value


def test_arithmetic_level_is_one_or_two_small_steps(corpus):
    rows = [d for d in corpus if d["task"] == "arith"]
    steps = [len(re.findall(r" = ", d["solution"])) for d in rows]
    assert set(steps) == {1, 2} and 0.3 < steps.count(2) / len(steps) < 0.7
    assert all(0 <= int(d["answer"]) <= 29 for d in rows)
    assert all(d["text"].startswith("Question: ") and "\nAnswer: " in d["text"] for d in rows)


def test_quest_middle_is_a_function_of_the_last_sentence_alone(corpus):
    """Sentences 2-4 are determined by sentence 5 (the goal) and hold nothing of sentence 1 (no copying),
    and sentence 1 says nothing about the goal: the suffix-dependent infilling task."""
    rows = [d for d in corpus if d["task"] == "quest"]
    middle_of: dict = {}
    for d in rows:
        s = d["sentences"]
        name = s[0].split("about ")[1].split(",")[0]
        outcome = s[4].split(" ", 3)[3]                       # "At last she <outcome> ..." without the pronoun
        assert middle_of.setdefault(outcome, " ".join(s[1:4])) == " ".join(s[1:4])
        assert name not in " ".join(s[1:4]) and len(s) == 5 and d["text"] == " ".join(s)
    assert len(middle_of) == 8
    goals_by_first = {}
    for d in rows:
        goals_by_first.setdefault(d["sentences"][0].split(",", 1)[1], set()).add(d["goal"])
    assert max(len(g) for g in goals_by_first.values()) >= 4      # the left context leaves the goal open


def test_heldout_split_is_per_task_and_never_in_training(corpus, tmp_path):
    from setdiff_mega.data.corpus import split_heldout
    from setdiff_mega.data.prepare import embedded_is_current, prepare

    held, train = split_heldout(corpus, 16)
    assert {k: len(v) for k, v in held.items()} == {"math": 16, "story": 16, "arith": 16, "quest": 16}
    texts = {d["text"] for rows in held.values() for d in rows}
    assert not texts & {d["text"] for d in train}
    out = tmp_path / "emb"
    prepare(out, None, num_math=40, num_stories=40, vocab_size=300, heldout=4, log=lambda *a: None)
    assert embedded_is_current(out, {}) and embedded_is_current(out, {"num_math": 40, "num_quests": 26})
    assert not embedded_is_current(out, {"num_stories": 41})
    spec = json.loads((out / "embedded.json").read_text())
    (out / "embedded.json").write_text(json.dumps({**spec, "version": 1}))
    assert not embedded_is_current(out, {})                  # an older generator's corpus is rebuilt
    assert sorted(p.name for p in (out / "tasks").iterdir()) == ["arith.jsonl", "math.jsonl", "quests.jsonl",
                                                                 "stories.jsonl"]
    (out / "cache").mkdir()
    (out / "cache" / "stale-index.npy").write_bytes(b"x")
    prepare(out, None, num_math=40, num_stories=40, vocab_size=300, heldout=4, log=lambda *a: None)
    # the index cache is keyed by the data's content (data/loader.py): rebuilding the corpus removes nothing
    assert (out / "cache" / "stale-index.npy").read_bytes() == b"x"
    with pytest.raises(DataError, match="every generated document is held out.*lower --heldout"):
        prepare(tmp_path / "none", None, num_math=3, num_stories=3, vocab_size=300, heldout=8, log=lambda *a: None)


def test_stories_have_five_sentences(corpus):
    for d in (d for d in corpus if d["task"] == "story"):
        assert len(d["sentences"]) == 5 and d["text"] == " ".join(d["sentences"])


def test_tokenizer_specials_and_round_trip(tokenizer, tmp_path):
    ids = tokenizer.special_ids
    assert len(set(ids.values())) == 4 and max(ids.values()) < tokenizer.vocab_size
    for text in ["Question: 3 + 4 = 7", "  leading spaces\n\nblank lines\n", "unicode: é, 中文, 😀",
                 "x" * 5000, ""]:
        assert tokenizer.decode(tokenizer.encode(text)) == text
    tokenizer.save(tmp_path / "tok.json")
    again = Tokenizer.from_file(tmp_path / "tok.json")
    assert again.special_ids == ids and again.hash == tokenizer.hash
    assert again.unique_identifiers["hash"] == tokenizer.hash


def test_indexed_round_trip_through_megatron_reader(tokenizer, corpus, tmp_path):
    from setdiff_mega.compat import mcore_cpu  # noqa: F401  (imports megatron with the shim)
    # isort: split
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    docs = [[tokenizer.bos] + tokenizer.encode(d["text"]) + [tokenizer.eos] for d in corpus[:50]]
    m = write_indexed(tmp_path / "c", docs, tokenizer.vocab_size, {"hash": tokenizer.hash})
    assert m["num_documents"] == 50 and m["num_tokens"] == sum(map(len, docs)) and m["dtype"] == "uint16"
    ds = IndexedDataset(str(tmp_path / "c"))
    assert len(ds) == 50
    for i in (0, 17, 49):
        assert np.array_equal(ds[i], np.array(docs[i]))
        assert tokenizer.decode(ds[i][1:-1]) == corpus[i]["text"]
    assert json.loads((tmp_path / "c.manifest.json").read_text())["sha256"]["bin"] == m["sha256"]["bin"]
    assert check_dataset(tmp_path / "c", tokenizer.vocab_size, verify_hashes=True)["num_documents"] == 50


def test_data_errors_name_file_and_problem(tokenizer, tmp_path):
    with pytest.raises(DataError, match=r"data file '.*missing.bin' does not exist; set data.path"):
        check_dataset(tmp_path / "missing")
    write_indexed(tmp_path / "d", [[1, 2, 3], [4, 300]], 400)
    with pytest.raises(DataError, match=r"holds token id 300 but the model vocabulary has only 100 entries"):
        check_dataset(tmp_path / "d", vocab_size=100)
    with pytest.raises(DataError, match="outside the vocabulary"):
        write_indexed(tmp_path / "e", [[1, 500]], 400)
    with pytest.raises(DataError, match="input is empty"):
        write_indexed(tmp_path / "f", [[]], 400)
    (tmp_path / "d.idx").write_bytes(b"NOTMMIDX" + b"\0" * 40)
    with pytest.raises(DataError, match=r"index file '.*d.idx' does not start with megatron-core's index header"):
        check_dataset(tmp_path / "d")
    write_indexed(tmp_path / "g", [[1, 2, 3], [4, 5]], 400)
    with open(tmp_path / "g.bin", "r+b") as f:
        f.truncate(4)
    with pytest.raises(DataError, match=r"'.*g.bin' has 4 bytes but its index expects 10"):
        check_dataset(tmp_path / "g")


def test_read_documents(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "one"}\n\n{"text": "two"}\n')
    assert list(read_documents(tmp_path / "a.jsonl")) == ["one", "two"]
    with pytest.raises(DataError, match=r"a.jsonl:1: JSON key 'body' does not exist"):
        list(read_documents(tmp_path / "a.jsonl", "body"))
    (tmp_path / "b.txt").write_text("para one\nline two\n\n\npara two\n")
    assert list(read_documents(tmp_path / "b.txt")) == ["para one\nline two", "para two"]
