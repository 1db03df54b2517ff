"""The README and the guides (docs/guide/*.md) say only what the code does (issue 58).

* Every ``tools/*.py`` is named in README.md or a guide.
* Every command line in them that runs a tool (``tools/NAME.py``) or the trainer (``pretrain/pretrain.py``, also
  after ``launch.sh ... --``) uses only flags that the program's argparse parser defines, and ``launch.sh`` only
  its own options. Command lines are the lines of ``bash`` / ``sh`` code blocks (``\\`` continuations joined)
  and the inline code spans of the prose that hold a tool's path.
* Every relative link points at an existing file, and every ``#anchor`` at a heading of its target (GitHub's
  slugs: lower case, punctuation dropped, spaces to ``-``).

A program's parser is captured by running its ``__main__`` with ``ArgumentParser.parse_args`` intercepted: the
tool builds its parser exactly as on the command line and stops before any work. Each program is run once per
session (the imports are shared), so the test costs the tools' imports only.
"""
from __future__ import annotations

import argparse
import functools
import re
import runpy
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs" / "guide").glob("*.md"))]
PROGRAM = re.compile(r"(?:^|/)(tools/[A-Za-z_0-9]+\.py|pretrain/[A-Za-z_0-9]+\.py)$")
SEPARATORS = {"|", "||", "&&", ";", "&", ">", ">>", "<", "2>", "2>&1", "(", ")"}
FLAG = re.compile(r"^(--[A-Za-z][\w-]*|-[A-Za-z])(=.*)?$")


class _Captured(BaseException):
    """Raised from the intercepted parse_args with the parser (a BaseException: run_cli lets it through)."""

    def __init__(self, parser: argparse.ArgumentParser):
        super().__init__()
        self.parser = parser


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _split_fences(text: str) -> tuple[list[tuple[str, str]], str]:
    """([(language, body)] of the fenced code blocks, the prose with the blocks blanked out)."""
    blocks, prose, lang, body = [], [], None, []
    for line in text.splitlines():
        fence = re.match(r"^\s*```(\w*)", line)
        if fence and lang is None:
            lang, body = fence.group(1) or "", []
        elif fence:
            blocks.append((lang, "\n".join(body)))
            lang = None
        elif lang is None:
            prose.append(line)
        else:
            body.append(line)
    return blocks, "\n".join(prose)


def _shell_lines(body: str) -> list[str]:
    joined, cur = [], ""
    for line in body.splitlines():
        if line.rstrip().endswith("\\"):
            cur += line.rstrip()[:-1] + " "
        else:
            joined.append(cur + line)
            cur = ""
    return [line for line in joined + ([cur] if cur else []) if line.strip()]


def _tokens(line: str) -> list[str]:
    lex = shlex.shlex(line, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    return list(lex)


def commands() -> list[tuple[str, str]]:
    """(where, command line) of every shell line and every inline code span that runs a program."""
    found = []
    for doc in DOCS:
        blocks, prose = _split_fences(_text(doc))
        for lang, body in blocks:
            if lang in ("bash", "sh", "shell", "console"):
                found += [(doc.name, line) for line in _shell_lines(body)]
        for span in re.findall(r"`([^`]+)`", prose):
            span = " ".join(span.split())
            if any(PROGRAM.search(tok) for tok in span.split()):
                found.append((doc.name, span))
    return found


def invocations(line: str) -> list[tuple[str, list[str]]]:
    """(program, its arguments up to the next shell separator) for each program the line runs; launch.sh's own
    arguments are checked as the program ``launch.sh`` and the trainer's after its ``--``."""
    toks, out = _tokens(line), []
    for i, tok in enumerate(toks):
        m = PROGRAM.search(tok)
        name = m.group(1) if m else ("launch.sh" if tok.endswith("launch.sh") else None)
        if name is None:
            continue
        args = []
        for t in toks[i + 1:]:
            if t in SEPARATORS:
                break
            args.append(t)
        if name == "launch.sh" and "--" in args:
            cut = args.index("--")
            out += [("launch.sh", args[:cut]), ("pretrain/pretrain.py", args[cut + 1:])]
        else:
            out.append((name, args))
    return out


@functools.cache
def parser_of(program: str) -> argparse.ArgumentParser:
    """The program's parser, as its ``__main__`` builds it (parse_args intercepted before any work)."""
    path = ROOT / program
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    real_parse_args, real_parse_known = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args

    def capture(self, *_a, **_k):
        raise _Captured(self)

    argparse.ArgumentParser.parse_args = capture
    argparse.ArgumentParser.parse_known_args = capture
    sys.argv = [str(path)]
    sys.path.insert(0, str(path.parent))
    try:
        runpy.run_path(str(path), run_name="__main__")
    except _Captured as c:
        return c.parser
    finally:
        argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args = real_parse_args, real_parse_known
        sys.argv[:], sys.path[:] = saved_argv, saved_path
    raise AssertionError(f"{program} never parsed its arguments: the test cannot see its flags")


def _flags(parser: argparse.ArgumentParser) -> tuple[set, dict]:
    """(the parser's option strings, {subcommand: its parser})."""
    opts, subs = set(), {}
    for action in parser._actions:                    # argparse exposes its actions only here
        opts.update(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            subs.update(action.choices)
    return opts, subs


def allowed_flags(program: str, args: list[str]) -> set:
    """The flags ``program args`` may use: the parser's, plus the named subcommand's (all subcommands' when the
    tool inserts a default one, as lm-eval's ``run``)."""
    opts, subs = _flags(parser_of(program))
    if subs:
        positional = next((a for a in args if not a.startswith("-")), None)
        chosen = [subs[positional]] if positional in subs else list(subs.values())
        for sub in chosen:
            opts |= _flags(sub)[0]
    return opts


def launch_flags() -> set:
    return set(re.findall(r"^\s*(--[a-z][\w-]*)\)", _text(ROOT / "launch.sh"), re.M))


def test_commands_are_found():
    """The extraction itself: the README's train and generate lines are seen, with their programs and flags."""
    lines = [line for _, line in commands()]
    runs = [inv for line in lines for inv in invocations(line)]
    assert ("pretrain/pretrain.py", ["--config", "configs/tiny_cpu.yaml", "--print-config"]) in [
        (p, a[:3]) for p, a in runs]
    assert any(p == "tools/generate.py" and "--tau" in a for p, a in runs)
    assert any(p == "pretrain/pretrain.py" for p, a in invocations("./launch.sh --nproc-per-node 2 -- --config x.yaml"))
    assert invocations("python tools/x.py --a 1 | tee log") == [("tools/x.py", ["--a", "1"])]
    flags = allowed_flags("tools/generate.py", [])
    assert "--tau" in flags and "--checkpoint" in flags and "--no-such-flag" not in flags


def test_every_tool_is_documented():
    text = "\n".join(_text(doc) for doc in DOCS)
    missing = [p.name for p in sorted((ROOT / "tools").glob("*.py")) if p.name not in text]
    assert not missing, f"tools not named in README.md or docs/guide/*.md: {missing}; add each to the README's Layout"


def test_documented_flags_exist():
    bad = []
    launch = launch_flags()
    for where, line in commands():
        for program, args in invocations(line):
            known = launch if program == "launch.sh" else None
            if known is None:
                if not (ROOT / program).is_file():
                    bad.append(f"{where}: {program} does not exist: {line}")
                    continue
                known = allowed_flags(program, args)
            for arg in args:
                m = FLAG.match(arg)
                if m and m.group(1) not in known:
                    bad.append(f"{where}: {program} has no flag {m.group(1)}: {line}")
    assert not bad, "documented commands use flags their program does not define:\n" + "\n".join(bad)


def _slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set:
    _, prose = _split_fences(_text(path))
    return {_slug(m) for m in re.findall(r"^#+\s+(.*)$", prose, re.M)}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_relative_links_resolve(doc):
    _, prose = _split_fences(_text(doc))
    bad = []
    for target in re.findall(r"\]\(([^)\s]+)\)", prose):
        if re.match(r"^[a-z]+:", target):
            continue                                  # http(s):, mailto:
        file, _, anchor = target.partition("#")
        path = (doc.parent / file).resolve() if file else doc
        if not path.exists():
            bad.append(f"{target}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            bad.append(f"{target}: no heading with the anchor #{anchor}")
    assert not bad, f"{doc.relative_to(ROOT)}: broken links: {bad}"
