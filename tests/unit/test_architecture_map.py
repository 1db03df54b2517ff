"""docs/architecture.md is the map of the code (issue 58): every package, module and tool is named in it, so a
newcomer finds each one where the map says, and a module added without its line fails here."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
PACKAGES = ("setdiff_mega", "experiments", "benchmarks")


def _named(doc: str, stem: str) -> bool:
    """``stem`` as a word of its own (``scheduler``, ``scheduler.py``, ``serving/scheduler.py``)."""
    return re.search(rf"(?<![\w.-]){re.escape(stem)}(\.py)?(?![\w-])", doc) is not None


def missing_from_map(doc: str) -> list[str]:
    out = []
    for base in PACKAGES:
        top = ROOT / base
        for f in sorted(top.rglob("*.py")):
            if f.name != "__init__.py" and not _named(doc, f.stem):
                out.append(str(f.relative_to(ROOT)))
        for d in sorted(p for p in top.rglob("*") if p.is_dir() and (p / "__init__.py").is_file()):
            if f"{d.name}/" not in doc:
                out.append(f"{d.relative_to(ROOT)}/")
        if f"{base}/" not in doc:
            out.append(f"{base}/")
    for f in sorted((ROOT / "tools").glob("*.py")):
        if not f.name.startswith("_") and not _named(doc, f.stem):
            out.append(str(f.relative_to(ROOT)))
    return out


def test_every_package_module_and_tool_is_on_the_map():
    missing = missing_from_map(DOC.read_text())
    assert missing == [], f"docs/architecture.md does not name: {', '.join(missing)} (add each where it belongs)"


def test_the_check_can_fail():
    assert missing_from_map("") != []
    assert _named("serving/scheduler.py (the loop)", "scheduler")
    assert not _named("the scheduler_loop", "scheduler") and not _named("pre-scheduler", "scheduler")
