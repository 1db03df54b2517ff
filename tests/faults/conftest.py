"""Shared fixtures for the fault-injection suite: two small tokenizers and a dataset made with the first
(the tiny model overrides, the CLI runner, the prepared corpus and the trained run are the end-to-end
suite's), a tool's ``main`` run in this process, and a snapshot of a user's files."""
import hashlib
from pathlib import Path

import pytest

from ..distributed.test_parallel_training import tiny_data  # noqa: F401  (a fixture: DP/TP runs)

# re-exported to the fault tests; data_dir and trained_run are fixtures shared with tests/e2e
from ..e2e.conftest import ROOT, TINY, data_dir, tool, trained_run  # noqa: F401
from ..e2e.conftest import _run as run_tool  # noqa: F401


def run_main(capsys, name: str, argv: list) -> tuple[int, str]:
    """(exit status, stderr) of ``tools/<name>.py argv`` run in this process through the CLI wrapper."""
    from setdiff_mega.cli import run_cli

    capsys.readouterr()
    rc = run_cli(tool(name).main, [str(a) for a in argv])
    return rc, capsys.readouterr().err


def snapshot(root: Path) -> dict:
    """relative path -> SHA-256 of every file under ``root`` (but a run directory's ``.lock``, which names
    its latest holder)."""
    return {str(f.relative_to(root)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(Path(root).rglob("*")) if f.is_file() and f.name != ".lock"}


def kept(before: dict, root: Path) -> None:
    """Every file of ``before`` is still under ``root`` with the same bytes."""
    after = snapshot(root)
    lost = sorted(k for k in before if k not in after)
    changed = sorted(k for k in before if k in after and after[k] != before[k])
    assert not lost and not changed, {"removed": lost, "changed": changed}


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
