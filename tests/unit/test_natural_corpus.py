"""The natural corpus (setdiff_mega/data/natural.py, ``tools/prepare_data.py --natural``): installed Python
sources, deduplicated, shuffled by a fixed seed, capped; its provenance decides ``--skip-existing``."""
import json

import pytest

from setdiff_mega.data.indexed import check_dataset
from setdiff_mega.data.natural import Source, default_sources, natural_documents, natural_is_current, split_long


def _tree(root, files: dict):
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(text) if isinstance(text, bytes) else p.write_text(text)
    return root


def _sources(tmp_path):
    a = _tree(tmp_path / "a", {"x.py": "def f():\n    return 1   \n", "sub/y.py": "import os\n\nprint(os.sep)\n",
                               "notes.txt": "not python", "bad.py": b"\xff\xfe broken"})
    b = _tree(tmp_path / "b", {"copy.py": "def f():\n    return 1\n", "z.py": "class Z:\n    pass\n",
                               "empty.py": "\n\n"})
    return [Source("a", a, "1"), Source("b", b, "2")]


def test_documents_are_deduplicated_shuffled_by_seed_and_recorded(tmp_path):
    docs, rec = natural_documents(_sources(tmp_path), log=lambda *a: None)
    assert sorted(docs) == sorted(["def f():\n    return 1", "import os\n\nprint(os.sep)", "class Z:\n    pass"])
    a, b = rec["sources"]
    assert (a["kept"], a["undecodable"], a["duplicates"]) == (2, 1, 0)      # .txt ignored, bad UTF-8 skipped
    assert (b["kept"], b["duplicates"]) == (1, 1)                            # the copy (trailing spaces aside)
    again, rec2 = natural_documents(_sources(tmp_path), log=lambda *a: None)
    assert again == docs and natural_is_current(rec, rec2)
    other, rec3 = natural_documents(_sources(tmp_path), seed=1, log=lambda *a: None)
    assert sorted(other) == sorted(docs) and not natural_is_current(rec, rec3)


def test_the_cap_keeps_whole_documents_up_to_the_budget(tmp_path):
    docs, rec = natural_documents(_sources(tmp_path), max_mb=40e-6, log=lambda *a: None)
    assert 0 < len(docs) < 3 and rec["bytes"] == sum(len(d.encode()) for d in docs) <= 40
    assert rec["documents_before_cap"] == 3


def test_long_files_are_cut_at_blank_lines():
    text = "\n\n".join(f"def f{i}():\n    return {i}" for i in range(50))
    pieces = split_long(text, 100)
    assert len(pieces) > 5 and all(len(p) <= 100 for p in pieces)
    assert "\n\n".join(pieces) == text
    assert split_long("short", 100) == ["short"]


def test_the_default_sources_are_the_stdlib_and_installed_packages():
    srcs = default_sources()
    assert srcs[0].name == "stdlib" and (srcs[0].root / "os.py").is_file()
    assert all(s.root.is_dir() for s in srcs) and len(srcs) > 3


def test_prepare_data_natural_builds_a_corpus_and_skips_an_identical_one(tmp_path, capsys):
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("prepare_data", root / "tools" / "prepare_data.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    src = _tree(tmp_path / "src", {f"m{i}.py": f"def f{i}(x):\n    return x * {i} + {i * i}\n" for i in range(40)})
    out = tmp_path / "out"
    argv = ["--natural", "--natural-root", str(src), "--out", str(out), "--vocab-size", "300", "--skip-existing"]
    assert tool.main(argv) == 0
    rec = json.loads((out / "natural.json").read_text())
    assert rec["documents"] == 40 and check_dataset(out / "corpus")["num_documents"] == 40
    capsys.readouterr()
    assert tool.main(argv) == 0 and "skipping" in capsys.readouterr().out
    (src / "m0.py").write_text("def changed():\n    pass\n")
    assert tool.main(argv) == 0 and "rebuilding" in capsys.readouterr().out
    with pytest.raises(FileNotFoundError, match="--natural-root"):
        tool.main(["--natural", "--natural-root", str(tmp_path / "nope"), "--out", str(tmp_path / "o2")])
