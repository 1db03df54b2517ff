"""What every task is: a :class:`Problem` record, the :class:`Knob` settings that set its difficulty, and the
:class:`Task` contract (generate, verify, the two text layouts).

A problem carries two strings that decide where it may go (``splits.py``):

* ``key``: its **canonical computation** (a Sudoku's givens, sorted operands + the operator structure, a
  graph with its query): equal keys are the same problem whatever the names, order or wording around it;
* ``group``: the **split unit**, the coarsest string that two problems share when they share a computation
  *or* a reference answer (a Sudoku's solution grid, a product, a path). The split is a hash of the group, so a
  test problem's computation and its reference answer never occur in training data.

Two layouts of the same problem (the records :mod:`setdiff_mega.data.sft` renders):

* **grid** (models trained from scratch, the character vocabulary of ``setdiff_mega.data.tokenizer.Tokenizer.
  characters``: one token per character, one per grid cell)::

      [BOS] prompt characters [SEP] answer characters [EOS]

  ``prompt`` is :meth:`Task.grid_prompt` + ``SEP`` (context), ``response`` :meth:`Task.grid_answer` (the target).
  Every task except ``arithmetic`` has a fixed prompt and answer length per knob setting (:meth:`Task.layout`), so
  the answer starts at token ``1 + prompt_chars + 1``.
* **chat** (fine-tuning a pretrained LM with its own tokenizer and chat template): ``prompt`` is a natural user
  turn (:meth:`Task.chat_prompt`), ``response`` the assistant's answer (:meth:`Task.chat_response`).

``verify(problem, text)`` scores validity, not string equality: a Countdown expression is parsed and evaluated,
a Sudoku grid checked against the rules and the givens; it reads either layout's answer (the text after SEP, or the
assistant's reply).
"""
from __future__ import annotations

import abc
import random
import re
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

VERSION = 1                      # the generators' version: a change of any task's output bumps it
SEP = "<|sep|>"                  # the grid layout's separator: one special token of the character vocabulary
FORMATS = ("grid", "chat")
CHARACTERS = "".join(map(chr, range(32, 127))) + "\n"   # the grid layout's alphabet: printable ASCII, newline
_INT = re.compile(r"-?\d+")


class TaskError(ValueError):
    """A bad task name, knob or record; the message names it and the fix."""


@dataclass(frozen=True)
class Knob:
    """One difficulty setting: an integer in [lo, hi] with a default."""
    name: str
    default: int
    lo: int
    hi: int
    help: str = ""


@dataclass
class Problem:
    task: str                    # registry name
    knob: dict                   # the knob settings it was drawn at
    question: dict               # the task's own fields (JSON): givens, operands and target, edges, ...
    answer: str                  # the reference answer, canonical text (solution grid, product, expression, path)
    key: str                     # canonical computation (module docstring)
    group: str                   # split unit (module docstring)
    extra: dict = field(default_factory=dict)   # more fields a task keeps (the worked solution, ...)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Problem":
        try:
            return cls(d["task"], dict(d["knob"]), dict(d["question"]), str(d["answer"]), str(d["key"]),
                       str(d["group"]), dict(d.get("extra") or {}))
        except (KeyError, TypeError) as e:
            raise TaskError(f"not a task record (missing or bad {e}): write it with tools/prepare_data.py --task") \
                from None


class Task(abc.ABC):
    """Base class of the tasks: subclasses set ``name``, ``knobs`` and ``description`` and write the abstract
    methods below. ``fixed_length``: every grid document of a knob setting has the same length."""
    name: str = ""
    description: str = ""
    knobs: tuple = ()
    fixed_length: bool = True
    answer_checked: bool = True   # the bare answer string is kept out of training text (False: only the response,
                                  # when the answer is a short number that occurs everywhere)

    # -- knobs
    def knob(self, given: Optional[dict] = None) -> dict:
        """The full knob settings: ``given`` (name -> int) over the defaults, checked against the ranges."""
        given = dict(given or {})
        names = [k.name for k in self.knobs]
        unknown = sorted(set(given) - set(names))
        if unknown:
            raise TaskError(f"task {self.name} has no knob {unknown[0]!r}; its knobs: {', '.join(names)}")
        out = {}
        for k in self.knobs:
            v = given.get(k.name, k.default)
            if isinstance(v, bool) or not isinstance(v, int) or not k.lo <= v <= k.hi:
                raise TaskError(f"{self.name}: knob {k.name}={v!r} must be an integer in [{k.lo}, {k.hi}] ({k.help})")
            out[k.name] = v
        self.check_knob(out)
        return out

    def check_knob(self, knob: dict) -> None:
        """Cross-knob rules (raise TaskError)."""

    # -- the contract
    @abc.abstractmethod
    def generate(self, knob: dict, rng: random.Random, accept: Optional[Callable[[str], bool]] = None):
        """One problem at ``knob`` drawn with ``rng``, or None when ``accept(group)`` is False (a generator tests
        it as soon as the group is known, before any expensive work) or the draw failed."""

    @abc.abstractmethod
    def verify(self, problem: Problem, text: str) -> bool:
        """Whether ``text`` (the answer part of either layout) is a correct answer to ``problem``."""

    @abc.abstractmethod
    def grid_prompt(self, problem: Problem) -> str:
        """The puzzle as characters of the grid layout (SEP is added by :meth:`record`)."""

    @abc.abstractmethod
    def grid_answer(self, problem: Problem) -> str:
        """The reference answer as characters of the grid layout (the target)."""

    @abc.abstractmethod
    def chat_prompt(self, problem: Problem) -> str:
        """The problem as a user turn (the chat layout)."""

    @abc.abstractmethod
    def chat_response(self, problem: Problem) -> str:
        """The assistant's reference answer (the chat layout's target)."""

    def layout(self, knob: dict) -> Optional[tuple[int, int]]:
        """(prompt characters, answer characters) of every grid document at ``knob``; None when they vary."""
        return None

    # -- records
    def record(self, problem: Problem, fmt: str) -> dict:
        """The supervised record of ``problem`` in layout ``fmt`` (prompt = context, response = target), with the
        problem's fields for scoring."""
        if fmt == "grid":
            prompt, response = self.grid_prompt(problem) + SEP, self.grid_answer(problem)
        elif fmt == "chat":
            prompt, response = self.chat_prompt(problem), self.chat_response(problem)
        else:
            raise TaskError(f"format {fmt!r} is not one of {', '.join(FORMATS)}")
        return {"prompt": prompt, "response": response, "format": fmt, **problem.to_dict()}

    def heldout_strings(self, problem: Problem, record: dict) -> list[str]:
        """The strings of a held-out problem that must occur nowhere in training text: its response (the answer
        layout it is trained on) and, when ``answer_checked``, its bare reference answer."""
        return [record["response"]] + ([problem.answer] if self.answer_checked else [])


def last_int(text: str) -> Optional[int]:
    """The number after the last '####' if there is one, else the last integer of ``text`` (commas in numbers
    removed), or None."""
    tail = text.rsplit("####", 1)[1] if "####" in text else text
    nums = _INT.findall(tail.replace(",", ""))
    if not nums:
        return None
    return int(nums[0] if "####" in text else nums[-1])


def knob_tag(knob: dict) -> str:
    """A file-name tag of knob settings: ``givens30`` or ``operands4-target_max100``."""
    return "-".join(f"{k}{v}" for k, v in knob.items())


def parse_knobs(items) -> dict:
    """``["givens=30", "digits=3"]`` -> ``{"givens": 30, "digits": 3}``."""
    out = {}
    for item in items or []:
        for part in str(item).split(","):
            name, eq, value = part.partition("=")
            try:
                if not eq:
                    raise ValueError
                out[name.strip()] = int(value)
            except ValueError:
                raise TaskError(f"--knob {part!r} must look like NAME=INTEGER, e.g. givens=30") from None
    return out


__all__ = ["VERSION", "CHARACTERS", "Problem", "Task", "Knob", "TaskError", "SEP", "FORMATS", "last_int", "knob_tag",
           "parse_knobs"]
