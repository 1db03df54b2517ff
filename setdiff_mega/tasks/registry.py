"""The task registry: name -> :class:`~.base.Task` (one instance per task; Sudoku has two sizes)."""
from __future__ import annotations

from .addition import ADDITION
from .arithmetic import ARITHMETIC
from .base import Task, TaskError
from .countdown import COUNTDOWN
from .multiplication import MULTIPLICATION
from .pathstar import PATHSTAR
from .sudoku import SUDOKU4, SUDOKU9

TASKS: dict[str, Task] = {t.name: t for t in (SUDOKU4, SUDOKU9, COUNTDOWN, MULTIPLICATION, PATHSTAR, ARITHMETIC,
                                          ADDITION)}


def get(name: str) -> Task:
    try:
        return TASKS[name]
    except KeyError:
        raise TaskError(f"unknown task {name!r}; tasks: {', '.join(TASKS)}") from None


def names() -> list[str]:
    return list(TASKS)


__all__ = ["TASKS", "get", "names"]
