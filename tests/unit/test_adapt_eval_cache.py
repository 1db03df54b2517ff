"""Cached accuracies are keyed by the code that produced them and say where they were computed (issue 55)."""
from experiments.adapt import evaluate as E
from experiments.adapt.report import _computed_at


def _fingerprint(monkeypatch, root):
    monkeypatch.setattr(E, "_PACKAGE", root)
    monkeypatch.setattr(E, "CODE_PATHS", ("decoding", "eval/tasks.py"))
    E.code_fingerprint.cache_clear()
    try:
        return E.code_fingerprint()
    finally:
        E.code_fingerprint.cache_clear()


def test_fingerprint_follows_every_scored_source(tmp_path, monkeypatch):
    (tmp_path / "decoding" / "sub").mkdir(parents=True)
    (tmp_path / "eval").mkdir()
    (tmp_path / "decoding" / "a.py").write_text("x = 1\n")
    (tmp_path / "decoding" / "sub" / "b.py").write_text("y = 2\n")
    (tmp_path / "eval" / "tasks.py").write_text("z = 3\n")
    (tmp_path / "eval" / "other.py").write_text("w = 4\n")
    base = _fingerprint(monkeypatch, tmp_path)
    assert base == _fingerprint(monkeypatch, tmp_path)
    (tmp_path / "eval" / "other.py").write_text("w = 5\n")          # not a scored source: same key
    assert _fingerprint(monkeypatch, tmp_path) == base
    for f in ("decoding/sub/b.py", "eval/tasks.py"):
        old = (tmp_path / f).read_text()
        (tmp_path / f).write_text(old + "# changed\n")
        assert _fingerprint(monkeypatch, tmp_path) != base, f
        (tmp_path / f).write_text(old)
    (tmp_path / "decoding" / "sub" / "b.py").rename(tmp_path / "decoding" / "c.py")   # same bytes, other file
    assert _fingerprint(monkeypatch, tmp_path) != base


def test_real_sources_exist():
    for rel in E.CODE_PATHS:
        assert (E._PACKAGE / rel).exists(), rel
    assert len(E.code_fingerprint()) == 16


def test_report_prints_where_accuracies_were_computed():
    pts = [{"computed_at": {"commit": "abc1234", "code": "f" * 16}}] * 2 + [{}]
    s = _computed_at(pts)
    assert "abc1234 (code ffffffffffffffff): 2 points" in s and "unrecorded" in s
