"""Answer-only addition of two integers of ``digits`` digits whose sum has ``digits + 1`` digits (knob: more digits,
harder): the task where left to right is the wrong order (each digit of the sum depends on the carries from its
right) that a pretrained LM fine-tuned briefly still solves part of the time.

A draw is ``a``, ``b`` uniform over the ``digits``-digit integers, redrawn (inside the same draw, so a draw stays a
function of its random stream) until ``a + b >= 10^digits``: the sum then has one digit more than any operand, so a
test answer is never an operand of a training problem (the leak check looks for every test answer as a whole
token in the training text). key: the operands sorted (a + b is b + a); group: the **sum**, so a test answer is
never a training answer. Distinct sums: 9 x 10^(digits-1) (3 digits: 999, 1000..1998), computations about half of
the 8.1 x 10^(2 digits - 2) pairs.

Grid layout: ``[BOS] a+b [SEP] sum [EOS]`` (3 digits: 7 + 4 characters). Chat: "What is 123 + 987? Answer with the
number only." -> ``1110``. ``verify``: the number after the last ``####``, else the last integer of the text, equals
the sum.
"""
from __future__ import annotations

from .base import Knob, Problem, Task, last_int


class Addition(Task):
    name = "addition"
    description = "answer-only addition by number of digits (the sum one digit longer)"
    knobs = (Knob("digits", 4, 2, 17, "digits of each operand"),)

    def generate(self, knob, rng, accept=None):
        d = knob["digits"]
        while True:
            a, b = rng.randint(10 ** (d - 1), 10 ** d - 1), rng.randint(10 ** (d - 1), 10 ** d - 1)
            if a + b >= 10 ** d:
                break
        group = str(a + b)
        if accept is not None and not accept(group):
            return None
        lo, hi = sorted((a, b))
        return Problem(self.name, dict(knob), {"a": a, "b": b}, group, f"{lo}+{hi}", group)

    def verify(self, problem, text):
        return last_int(text) == problem.question["a"] + problem.question["b"]

    def grid_prompt(self, problem):
        return f"{problem.question['a']}+{problem.question['b']}"

    def grid_answer(self, problem):
        return problem.answer

    def chat_prompt(self, problem):
        return f"What is {problem.question['a']} + {problem.question['b']}? Answer with the number only."

    def chat_response(self, problem):
        return problem.answer

    def layout(self, knob):
        d = knob["digits"]
        return 2 * d + 1, d + 1


ADDITION = Addition()

__all__ = ["Addition", "ADDITION"]
