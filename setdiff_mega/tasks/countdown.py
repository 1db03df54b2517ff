"""Countdown: combine every operand exactly once with + - * / (and parentheses) to make the target (knobs: the
number of operands, the target range, the largest operand).

Rules the verifier applies (:func:`check`): the expression holds only integers, + - * / and parentheses (no unary
minus, at most 200 characters); the multiset of its integers equals the operands; it evaluates, in exact rational
arithmetic (a division by zero is invalid), to the target. Any such expression is correct: many are for most
problems. Parsing is a recursive-descent parser over the tokens, evaluation walks the tree with
:class:`fractions.Fraction`: no ``eval``.

Generation works backwards: the operands are drawn, then two items of the pool are combined at a time by an
operator that keeps every intermediate a non-negative integer (a - b with a >= b, exact divisions) until one is
left; a draw whose result falls outside [target_min, target_max] is redrawn. The reference answer is that
expression with the fewest parentheses. key = group = the sorted operands and the target: since every answer uses
all operands, a test answer cannot be a training answer.

Grid layout: operands zero-padded to the width of ``operand_max``, comma-separated, then ``=`` and the target
zero-padded to the width of ``target_max``; the answer is the expression right-padded with ``_`` to the longest an
expression of n operands can be (n numbers, n - 1 operators, at most n - 2 pairs of parentheses)::

    [BOS] 07,21,03,12=0084 [SEP] (21-7)*(12/3)_ ... _ [EOS]
"""
from __future__ import annotations

import random
from fractions import Fraction

from .base import Knob, Problem, Task, TaskError

PAD = "_"
OPS = "+-*/"
PREC = {"+": 1, "-": 1, "*": 2, "/": 2}
MAX_CHARS = 200


class ParseError(ValueError):
    pass


def tokenize(text: str) -> list:
    out, i = [], 0
    while i < len(text):
        ch = text[i]
        if ch.isspace():
            i += 1
        elif ch in "0123456789":
            j = i
            while j < len(text) and text[j] in "0123456789":
                j += 1
            out.append(int(text[i:j]))
            i = j
        elif ch in OPS or ch in "()":
            out.append(ch)
            i += 1
        else:
            raise ParseError(f"unexpected character {ch!r}")
    return out


def parse(text: str):
    """The expression tree of ``text``: an int leaf or (op, left, right); ParseError when it is not one."""
    if len(text) > MAX_CHARS:
        raise ParseError("too long")
    toks, pos = tokenize(text), 0

    def peek():
        return toks[pos] if pos < len(toks) else None

    def take():
        nonlocal pos
        pos += 1
        return toks[pos - 1]

    def atom():
        t = peek()
        if isinstance(t, int):
            return take()
        if t == "(":
            take()
            node = expr()
            if take_if(")") is None:
                raise ParseError("unbalanced parenthesis")
            return node
        raise ParseError(f"expected a number or '(' at token {pos}")

    def take_if(sym):
        return take() if peek() == sym else None

    def level(sub, ops):
        node = sub()
        while peek() in ops:
            op = take()
            node = (op, node, sub())
        return node

    def term():
        return level(atom, ("*", "/"))

    def expr():
        return level(term, ("+", "-"))

    tree = expr()
    if pos != len(toks):
        raise ParseError(f"unexpected token at {pos}")
    return tree


def evaluate(tree) -> Fraction:
    if isinstance(tree, int):
        return Fraction(tree)
    op, a, b = tree[0], evaluate(tree[1]), evaluate(tree[2])
    if op == "/" and b == 0:
        raise ZeroDivisionError
    return {"+": a + b, "-": a - b, "*": a * b}[op] if op != "/" else a / b


def leaves(tree) -> list:
    return [tree] if isinstance(tree, int) else leaves(tree[1]) + leaves(tree[2])


def check(text: str, operands: list, target: int) -> bool:
    """Whether ``text`` (padding ``_``, spaces and an ``= value`` tail ignored) uses every operand exactly once and
    equals the target."""
    expr = text.replace(PAD, " ").split("=", 1)[0].strip()
    try:
        tree = parse(expr)
        return sorted(leaves(tree)) == sorted(operands) and evaluate(tree) == target
    except (ParseError, ZeroDivisionError, RecursionError):
        return False


def show(tree, parent: int = 0, right: bool = False) -> str:
    """The expression with the fewest parentheses: a child is wrapped when it binds looser than its parent, or as
    tightly on the right of - or /."""
    if isinstance(tree, int):
        return str(tree)
    op, a, b = tree
    s = f"{show(a, PREC[op])}{op}{show(b, PREC[op], op in '-/')}"
    return f"({s})" if PREC[op] < parent or (right and PREC[op] == parent) else s


def combine(a: tuple, b: tuple, rng: random.Random):
    """(value, tree) of a random legal operator over two (value, tree) items, or None."""
    (x, tx), (y, ty) = (a, b) if a[0] >= b[0] else (b, a)
    choices = [("+", x + y), ("-", x - y), ("*", x * y)]
    if y and x % y == 0:
        choices.append(("/", x // y))
    op, v = rng.choice(choices)
    return v, (op, tx, ty)


class Countdown(Task):
    name = "countdown"
    description = "Countdown: every operand once with + - * / to make the target"
    knobs = (Knob("operands", 4, 2, 6, "numbers to combine, all of them used once"),
             Knob("target_min", 1, 0, 99999, "smallest target"),
             Knob("target_max", 100, 1, 99999, "largest target"),
             Knob("operand_max", 25, 2, 999, "operands are drawn from 1..operand_max"))

    def check_knob(self, knob):
        if knob["target_min"] > knob["target_max"]:
            raise TaskError(f"countdown: target_min={knob['target_min']} > target_max={knob['target_max']}")

    def generate(self, knob, rng, accept=None):
        n, lo, hi = knob["operands"], knob["target_min"], knob["target_max"]
        for _ in range(50):
            operands = [rng.randint(1, knob["operand_max"]) for _ in range(n)]
            pool = [(x, x) for x in operands]
            while len(pool) > 1:
                i, j = rng.sample(range(len(pool)), 2)
                item = combine(pool[i], pool[j], rng)
                pool = [p for k, p in enumerate(pool) if k not in (i, j)] + [item]
            target, tree = pool[0]
            if lo <= target <= hi:
                key = ",".join(map(str, sorted(operands))) + f"={target}"
                if accept is not None and not accept(key):
                    return None
                return Problem(self.name, dict(knob), {"operands": operands, "target": target}, show(tree), key, key)
        return None

    def verify(self, problem, text):
        return check(text, problem.question["operands"], problem.question["target"])

    def widths(self, knob) -> tuple[int, int, int]:
        """(operand width, target width, answer width) of the grid layout."""
        n, w = knob["operands"], len(str(knob["operand_max"]))
        return w, len(str(knob["target_max"])), n * w + (n - 1) + 2 * max(n - 2, 0)

    def grid_prompt(self, problem):
        w, t, _ = self.widths(problem.knob)
        return ",".join(f"{x:0{w}d}" for x in problem.question["operands"]) + f"={problem.question['target']:0{t}d}"

    def grid_answer(self, problem):
        return problem.answer.ljust(self.widths(problem.knob)[2], PAD)

    def chat_prompt(self, problem):
        nums = ", ".join(map(str, problem.question["operands"]))
        return (f"Use the numbers {nums}, each exactly once, with + - * / and parentheses to make "
                f"{problem.question['target']}. Answer with the expression only.")

    def chat_response(self, problem):
        return problem.answer

    def layout(self, knob):
        w, t, a = self.widths(knob)
        return knob["operands"] * (w + 1) + t, a


COUNTDOWN = Countdown()

__all__ = ["Countdown", "COUNTDOWN", "parse", "evaluate", "check", "show", "ParseError"]
