"""Shared fixtures for the fault-injection suite: two small tokenizers and a dataset made with the first
(the tiny model overrides and the CLI runner are the end-to-end suite's)."""
import pytest

from ..distributed.test_parallel_training import tiny_data  # noqa: F401  (a fixture: DP/TP runs)
from ..e2e.conftest import ROOT, TINY  # noqa: F401  (re-exported to the fault tests)
from ..e2e.conftest import _run as run_tool  # noqa: F401


def one_line_error(r, *needles):
    """The process failed with exit 2 and one ``error:`` line holding every needle, without a traceback."""
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    assert "Traceback" not in r.stderr and "Exception ignored" not in r.stderr, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: "), r.stderr[-3000:]
    for n in needles:
        assert n in last, (n, last)
    return last


@pytest.fixture(scope="session")
def two_tokenizers(tmp_path_factory):
    """(dir, tokenizer A, tokenizer B): A made the dataset ``dir/corpus``; B is another tokenizer."""
    from setdiff_mega.data import Tokenizer
    from setdiff_mega.data.indexed import write_indexed

    d = tmp_path_factory.mktemp("faults")
    texts_a = [f"Question: what is {i} plus {i + 1}? Answer: {2 * i + 1}." for i in range(300)]
    texts_b = [f"Once upon a time a fox named Rex{i % 7} ran to the river." for i in range(300)]
    a, b = Tokenizer.train(texts_a, vocab_size=300), Tokenizer.train(texts_b, vocab_size=300)
    a.save(d / "tokenizer.json")
    b.save(d / "other_tokenizer.json")
    docs = [[a.bos, *a.encode(t), a.eos] for t in texts_a * 4]
    write_indexed(d / "corpus", docs, a.vocab_size,
                  {"hash": a.hash, "vocab_size": a.vocab_size, "special_ids": a.special_ids})
    return d, a, b
