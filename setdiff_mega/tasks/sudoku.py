"""Sudoku, 4x4 (2x2 boxes) and 9x9 (3x3 boxes), uniquely solvable at an exact number of givens (the knob: fewer
givens, harder).

Cells are row-major, digits 1..n, 0 a blank. The solver keeps one bit mask of used digits per row, column and box
and branches on the blank with the fewest candidates (MRV); it stops after ``limit`` solutions.

Generation: a full grid by randomised search from the empty grid, then blanks dug in a random order, each kept
only if the puzzle stays uniquely solvable. Removing cell c (value v) from a uniquely solvable puzzle keeps it
unique iff no solution has a digit other than v at c, so each test is one search with v forbidden at c (no
solution counting). A pass that ends above the wanted number of givens is redone with another order, then another
grid. key: the puzzle (its givens); group: the solution grid, so a test solution never occurs in training data
(4x4 has only 288 grids: a test puzzle's grid is one the training data never shows).

Grid layout: ``[BOS] n*n puzzle digits [SEP] n*n solution digits [EOS]`` (4x4: 35 tokens, the answer from token
18; 9x9: 165 tokens, the answer from token 83). ``verify``: the text's digits are n*n, a valid grid, equal to the
puzzle at every given (validity, not string equality).
"""
from __future__ import annotations

import functools
import random

from .base import Knob, Problem, Task


@functools.lru_cache(maxsize=None)
def geometry(n: int) -> tuple:
    """(box side, row of cell, column of cell, box of cell) for an n x n grid."""
    b = int(round(n ** 0.5))
    cells = range(n * n)
    return b, [c // n for c in cells], [c % n for c in cells], [(c // n) // b * b + (c % n) // b for c in cells]


def _masks(cells: list, n: int):
    """Row, column and box masks of the filled cells; None when a digit repeats."""
    _, R, C, B = geometry(n)
    rows, cols, boxes = [0] * n, [0] * n, [0] * n
    for c, v in enumerate(cells):
        if v:
            bit = 1 << (v - 1)
            if (rows[R[c]] | cols[C[c]] | boxes[B[c]]) & bit:
                return None
            rows[R[c]] |= bit
            cols[C[c]] |= bit
            boxes[B[c]] |= bit
    return rows, cols, boxes


def solve(cells: list, n: int, limit: int = 2, forbid: tuple | None = None, rng: random.Random | None = None,
          stats: dict | None = None) -> list:
    """Up to ``limit`` solutions (lists of n*n digits) of ``cells``; ``forbid`` = (cell, digit) excludes that digit
    there; ``rng`` shuffles the candidates (random full grids); ``stats['guesses']`` counts branchings."""
    masks = _masks(cells, n)
    if masks is None:
        return []
    _, R, C, B = geometry(n)
    rows, cols, boxes = masks
    grid, out, full = list(cells), [], (1 << n) - 1
    blanks = [c for c, v in enumerate(grid) if not v]

    def search():
        best, best_mask, best_n = -1, 0, n + 1
        for c in blanks:
            if grid[c]:
                continue
            m = full & ~(rows[R[c]] | cols[C[c]] | boxes[B[c]])
            if forbid is not None and c == forbid[0]:
                m &= ~(1 << (forbid[1] - 1))
            k = m.bit_count()
            if k < best_n:
                best, best_mask, best_n = c, m, k
                if k <= 1:
                    break
        if best < 0:
            out.append(list(grid))
            return
        digits = [d for d in range(n) if best_mask >> d & 1]
        if rng is not None:
            rng.shuffle(digits)
        if stats is not None and len(digits) > 1:
            stats["guesses"] = stats.get("guesses", 0) + 1
        r, col, box = R[best], C[best], B[best]
        for d in digits:
            bit = 1 << d
            grid[best] = d + 1
            rows[r] |= bit
            cols[col] |= bit
            boxes[box] |= bit
            search()
            rows[r] &= ~bit
            cols[col] &= ~bit
            boxes[box] &= ~bit
            grid[best] = 0
            if len(out) >= limit:
                return

    search()
    return out


def is_solution(grid: list, n: int) -> bool:
    """A complete, valid n x n grid."""
    return len(grid) == n * n and all(1 <= v <= n for v in grid) and _masks(grid, n) is not None


def full_grid(n: int, rng: random.Random) -> list:
    return solve([0] * (n * n), n, limit=1, rng=rng)[0]


def dig(solution: list, n: int, givens: int, rng: random.Random) -> list | None:
    """A uniquely solvable puzzle of ``solution`` with exactly ``givens`` givens, or None (this order got stuck)."""
    cells, count = list(solution), n * n
    order = list(range(n * n))
    rng.shuffle(order)
    for c in order:
        if count == givens:
            break
        v, cells[c] = cells[c], 0
        if solve(cells, n, limit=1, forbid=(c, v)):
            cells[c] = v                          # another digit fits here: the blank would break uniqueness
        else:
            count -= 1
    return cells if count == givens else None


def _text(cells) -> str:
    return "".join(str(v) for v in cells)


class Sudoku(Task):
    fixed_length = True

    def __init__(self, n: int, default: int, lo: int):
        self.n = n
        self.name = f"sudoku{n}"
        self.description = f"{n}x{n} Sudoku, uniquely solvable, by number of givens"
        self.knobs = (Knob("givens", default, lo, n * n - 1, "filled cells of the puzzle; fewer is harder"),)

    def generate(self, knob, rng, accept=None):
        n, g = self.n, knob["givens"]
        for _ in range(8):
            sol = full_grid(n, rng)
            group = _text(sol)
            if accept is not None and not accept(group):
                return None
            for _ in range(4):
                puzzle = dig(sol, n, g, rng)
                if puzzle is not None:
                    return Problem(self.name, dict(knob), {"size": n, "puzzle": _text(puzzle)}, group,
                                   _text(puzzle), group)
        return None

    def verify(self, problem, text):
        digits = [int(ch) for ch in text if ch in "0123456789"]
        puzzle = [int(ch) for ch in problem.question["puzzle"]]
        return is_solution(digits, self.n) and all(p == 0 or p == d for p, d in zip(puzzle, digits))

    def rows(self, cells: str) -> list:
        return [cells[i:i + self.n] for i in range(0, self.n * self.n, self.n)]

    def grid_prompt(self, problem):
        return problem.question["puzzle"]

    def grid_answer(self, problem):
        return problem.answer

    def chat_prompt(self, problem):
        n, b = self.n, geometry(self.n)[0]
        return (f"Solve this {n}x{n} Sudoku. Replace every 0 with a digit so that each row, each column and each "
                f"{b}x{b} box contains the digits 1 to {n} exactly once.\n" + "\n".join(self.rows(
                    problem.question["puzzle"])) + "\nAnswer with the completed grid, one row per line.")

    def chat_response(self, problem):
        return "\n".join(self.rows(problem.answer))

    def layout(self, knob):
        return self.n * self.n, self.n * self.n


SUDOKU4 = Sudoku(4, default=6, lo=4)
SUDOKU9 = Sudoku(9, default=36, lo=24)

__all__ = ["Sudoku", "SUDOKU4", "SUDOKU9", "solve", "dig", "full_grid", "is_solution", "geometry"]
