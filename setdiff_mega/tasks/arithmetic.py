"""Multi-step arithmetic word problems with a worked solution, for fine-tuning a pretrained LM (knobs: ``steps``, the
equations of the solution; ``max_value``, the size of the numbers).

A person starts with a number of items; each event of the story changes it: gains (+), losses (-), packs bought
(k x m, then +: two equations), growth (x k) and equal shares (/ k, exact). Every intermediate is a positive
integer. The response is the worked solution, one equation per line in the order of the story, then ``#### answer``::

    Mia has 23 shells. Then she buys 4 packs with 12 shells in each pack. Then she gives away 17 of them.
    How many shells does Mia have now?
    ->  4 * 12 = 48
        23 + 48 = 71
        71 - 17 = 54
        #### 54

key = group: the **computation**, the equations with the operands of + and x sorted, whatever the names, items,
verbs and sentence order around them: the earlier study held problems out by question string and the test's worked
solutions were in its training data (one computation told with other names). The worked solution is a function of
the computation up to operand order, so a test solution never occurs in training text (checked when a dataset is
written); the bare final number is not kept out (numbers occur everywhere: ``answer_checked`` is False).
Distinct computations: about 10^4 at one step with numbers up to 100, and they multiply with every step.

``verify``: the number after the last ``####`` (else the last integer) equals the answer.
"""
from __future__ import annotations

from .base import Knob, Problem, Task, last_int

SHE = ["Ava", "Chloe", "Emma", "Grace", "Iris", "Kara", "Maya", "Olive", "Rosa", "Tara", "Uma", "Wendy", "Yara", "Mia",
       "Lena", "Nora", "Zoe", "Ella", "Ruby", "Lucy"]
HE = ["Ben", "Dan", "Finn", "Hugo", "Jack", "Leo", "Noah", "Paul", "Quinn", "Sam", "Victor", "Omar", "Eli", "Max",
      "Theo", "Ivan", "Luis", "Ravi", "Tom", "Adam"]
ITEMS = ["apples", "marbles", "stickers", "books", "coins", "pencils", "cookies", "shells", "cards", "stamps", "beads",
         "flowers", "buttons", "crayons", "pebbles", "ribbons"]
GAIN = ["buys", "finds", "receives", "wins", "picks up"]
LOSS = ["gives away", "loses", "sells", "uses"]
OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b, "/": lambda a, b: a // b}


def _event(rng, value: int, hi: int, room: int):
    """(sentence, [(a, op, b)], new value) of one random event that fits ``room`` equations, or None."""
    kinds = ["gain", "loss", "times", "share"] + (["packs"] if room >= 2 else [])
    kind = rng.choice(kinds)
    if kind == "gain":
        n = rng.randint(1, hi)
        return f"Then {{p}} {rng.choice(GAIN)} {n} more.", [(value, "+", n)]
    if kind == "loss" and value > 1:
        n = rng.randint(1, value - 1)
        return f"Then {{p}} {rng.choice(LOSS)} {n} of them.", [(value, "-", n)]
    if kind == "times" and value * 2 <= 10 * hi:
        k = rng.randint(2, min(5, 10 * hi // value))
        return f"Then {{p}} collects more until {{p}} has {k} times as many.", [(value, "*", k)]
    if kind == "share":
        ks = [k for k in range(2, 10) if value % k == 0]
        if ks:
            k = rng.choice(ks)
            return f"Then {{p}} splits them equally into {k} boxes and keeps one box.", [(value, "/", k)]
    if kind == "packs":
        k, m = rng.randint(2, 9), rng.randint(2, max(2, hi // 4))
        return f"Then {{p}} buys {k} packs with {m} {{item}} in each pack.", [(k, "*", m), (value, "+", k * m)]
    return None


def canonical(equations) -> str:
    """The computation: ``a op b`` per equation, the operands of + and * sorted."""
    return ";".join(f"{min(a, b)}{op}{max(a, b)}" if op in "+*" else f"{a}{op}{b}" for a, op, b in equations)


class Arithmetic(Task):
    name = "arithmetic"
    description = "multi-step arithmetic word problems with worked solutions"
    fixed_length = False
    answer_checked = False
    knobs = (Knob("steps", 3, 1, 12, "equations of the worked solution"),
             Knob("max_value", 100, 5, 100000, "the starting amount and the numbers added are at most this"))

    def generate(self, knob, rng, accept=None):
        steps, hi = knob["steps"], knob["max_value"]
        name = rng.choice(SHE + HE)
        pron, item = ("she" if name in SHE else "he"), rng.choice(ITEMS)
        value = rng.randint(2, hi)
        sentences, equations = [f"{name} has {value} {item}."], []
        while len(equations) < steps:
            ev = _event(rng, value, hi, steps - len(equations))
            if ev is None:
                continue
            text, eqs = ev
            equations += eqs
            value = OPS[equations[-1][1]](equations[-1][0], equations[-1][2])
            sentences.append(text.format(p=pron, item=item))
        key = canonical(equations)
        if accept is not None and not accept(key):
            return None
        sentences.append(f"How many {item} does {name} have now?")
        question = " ".join(s[0].upper() + s[1:] for s in sentences)
        solution = "\n".join(f"{a} {op} {b} = {OPS[op](a, b)}" for a, op, b in equations) + f"\n#### {value}"
        return Problem(self.name, dict(knob), {"text": question}, str(value), key, key, {"solution": solution})

    def verify(self, problem, text):
        return last_int(text) == int(problem.answer)

    def grid_prompt(self, problem):
        return problem.question["text"]

    def grid_answer(self, problem):
        return problem.extra["solution"]

    def chat_prompt(self, problem):
        return problem.question["text"] + "\nSolve it step by step and end with '#### ' and the answer."

    def chat_response(self, problem):
        return problem.extra["solution"]


ARITHMETIC = Arithmetic()

__all__ = ["Arithmetic", "ARITHMETIC", "canonical"]
