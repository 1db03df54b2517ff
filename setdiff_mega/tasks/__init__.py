"""Generated reasoning tasks with difficulty knobs, verifiers and splits held out by computation (issues 55, 56).

Pure Python (the standard library only: no torch, no megatron-core): one module per task, each a
:class:`~.base.Task` with ``generate(knob, rng)`` -> :class:`~.base.Problem` (prompt fields, reference answer,
canonical key, split group), ``verify(problem, text)`` and two layouts, ``grid`` (a character vocabulary for
models trained from scratch: [BOS] puzzle [SEP] answer [EOS]) and ``chat`` (a user turn and the assistant's
answer for a pretrained LM's chat template).

    sudoku4, sudoku9   Sudoku by number of givens (sudoku.py)
    countdown          every operand once with + - * / to the target; by operands and target range (countdown.py)
    multiplication     answer-only, by digits (multiplication.py)
    addition           answer-only, the sum a digit longer than the operands, by digits (addition.py)
    pathstar           path-star graph planning, by degree and arm length (pathstar.py)
    arithmetic         multi-step word problems with worked solutions, by steps (arithmetic.py)

``splits.py`` assigns train / dev / test by a hash of each problem's group and checks that no dev / test
computation, answer or solution occurs in training data; ``score.py`` scores generations. Datasets are written by
``tools/prepare_data.py --task`` (``setdiff_mega/data/prepare.py: prepare_task``); docs/tasks.md and
docs/method.md section 17 describe the layouts.
"""
from .base import CHARACTERS, FORMATS, SEP, VERSION, Knob, Problem, Task, TaskError, knob_tag, parse_knobs
from .registry import TASKS, get, names
from .score import score
from .splits import build_splits, check_heldout, split_of

__all__ = ["VERSION", "CHARACTERS", "Task", "Problem", "Knob", "TaskError", "SEP", "FORMATS", "TASKS", "get", "names",
           "knob_tag", "parse_knobs", "build_splits", "check_heldout", "split_of", "score"]
