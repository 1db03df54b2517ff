"""Cached study results are keyed by the code that produced them and say where they were computed (issue 55):
experiments/provenance.py and the adaptation study's cache key."""
import pytest

from experiments import provenance as P
from experiments.adapt import evaluate as E


def test_fingerprint_follows_every_listed_source(tmp_path):
    (tmp_path / "decoding" / "sub").mkdir(parents=True)
    (tmp_path / "eval").mkdir()
    (tmp_path / "decoding" / "a.py").write_text("x = 1\n")
    (tmp_path / "decoding" / "sub" / "b.py").write_text("y = 2\n")
    (tmp_path / "eval" / "tasks.py").write_text("z = 3\n")
    (tmp_path / "eval" / "other.py").write_text("w = 4\n")
    fp = lambda: P.fingerprint(("decoding", "eval/tasks.py"), tmp_path)        # noqa: E731
    base = fp()
    assert base == fp() and len(base) == 16
    (tmp_path / "eval" / "other.py").write_text("w = 5\n")          # not listed: same key
    assert fp() == base
    for f in ("decoding/sub/b.py", "eval/tasks.py"):
        old = (tmp_path / f).read_text()
        (tmp_path / f).write_text(old + "# changed\n")
        assert fp() != base, f
        (tmp_path / f).write_text(old)
    assert fp() == base
    (tmp_path / "decoding" / "sub" / "b.py").rename(tmp_path / "decoding" / "c.py")   # same bytes, another file
    assert fp() != base
    assert P.fingerprint(("decoding",), tmp_path, extra=(tmp_path / "eval" / "other.py",)) != \
        P.fingerprint(("decoding",), tmp_path)


def test_a_moved_source_is_refused_not_skipped(tmp_path):
    with pytest.raises(FileNotFoundError, match="moved"):
        P.fingerprint(("decoding",), tmp_path)


def test_the_real_decoding_code_is_listed_and_the_adaptation_key_uses_it():
    for rel in P.DECODING_CODE:
        assert (P.PACKAGE / rel).exists(), rel
    assert E.code_fingerprint() == P.fingerprint(P.DECODING_CODE, extra=(E.__file__,))


def test_report_prints_where_points_were_computed():
    pts = [{"computed_at": {"commit": "abc1234", "code": "f" * 16}}] * 2 + [{}]
    s = P.computed_at(pts)
    assert "abc1234 (code ffffffffffffffff): 2 points" in s and "unrecorded" in s
    assert P.computed_at([]) == "no points"
