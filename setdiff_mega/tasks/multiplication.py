"""Answer-only multiplication of two integers of ``digits`` and ``digits_b`` digits (0: the same; knob: more digits,
harder).

key: the operands sorted (a x b is b x a); group: the **product**, so two factorizations of one number land in
the same split and a test answer is never a training answer. With both operands of at least 2 digits the product
has more digits than either, so it is not an operand of another problem either. Distinct computations: 2 digits
x 2 digits about 4,000 (about 2,000 products), 3 x 3 about 405,000.

Grid layout: ``[BOS] a*b [SEP] product zero-padded to digits + digits_b [EOS]`` (3 x 3: 15 tokens, the answer from
token 9: ``123*456`` -> ``056088``). Chat: "What is 123 * 456? ..." -> ``56088``. ``verify``: the number after the
last ``####``, else the last integer of the text, equals the product (leading zeros allowed).
"""
from __future__ import annotations

from .base import Knob, Problem, Task, last_int


class Multiplication(Task):
    name = "multiplication"
    description = "answer-only multiplication by number of digits"
    knobs = (Knob("digits", 3, 2, 12, "digits of the first operand"),
             Knob("digits_b", 0, 0, 12, "digits of the second operand (0: as many as the first)"))

    @staticmethod
    def sizes(knob) -> tuple[int, int]:
        return knob["digits"], knob["digits_b"] or knob["digits"]

    def generate(self, knob, rng, accept=None):
        da, db = self.sizes(knob)
        a, b = rng.randint(10 ** (da - 1), 10 ** da - 1), rng.randint(10 ** (db - 1), 10 ** db - 1)
        group = str(a * b)
        if accept is not None and not accept(group):
            return None
        lo, hi = sorted((a, b))
        return Problem(self.name, dict(knob), {"a": a, "b": b}, group, f"{lo}*{hi}", group)

    def verify(self, problem, text):
        return last_int(text) == problem.question["a"] * problem.question["b"]

    def grid_prompt(self, problem):
        return f"{problem.question['a']}*{problem.question['b']}"

    def grid_answer(self, problem):
        return problem.answer.zfill(sum(self.sizes(problem.knob)))

    def chat_prompt(self, problem):
        return f"What is {problem.question['a']} * {problem.question['b']}? Answer with the number only."

    def chat_response(self, problem):
        return problem.answer

    def layout(self, knob):
        da, db = self.sizes(knob)
        return da + db + 1, da + db


MULTIPLICATION = Multiplication()

__all__ = ["Multiplication", "MULTIPLICATION"]
