"""Path-star planning (Bachmann & Nagarajan 2024, "The pitfalls of next-token prediction"): a star graph of
``degree`` arms of ``length`` nodes each counted from the centre (the centre included), its directed edges in a
shuffled list, the centre as the start and the leaf of one arm as the goal; the answer is the path from start to
goal (knobs: more arms and longer arms, harder).

Teacher-forced left-to-right models tend to fail it (the "Clever Hans" cheat: after the first node every next node
is the only successor of the previous one, so the loss never teaches the one hard step, choosing the arm); an
order that writes the path from the goal backwards needs no search. That makes it the planning task where the
order prior matters.

Nodes are distinct letters (a-z, A-Z: degree x (length - 1) + 1 <= 52), drawn at random for every problem. key:
the sorted edge list with the start and the goal; group: the **path** (a test path never occurs in training data,
under any graph).

Grid layout: the edges as ``uv`` pairs joined by ``,``, then ``|``, the start and the goal; the answer is the
``length`` nodes of the path::

    [BOS] ab,cd,ae,bf,...|ag [SEP] a e g [EOS]     (written without the spaces: aeg)

``verify``: the text's letters are a path that starts at the start, follows edges of the graph and ends at the
goal (the only such path in a tree).
"""
from __future__ import annotations

import string

from .base import Knob, Problem, Task, TaskError

LABELS = string.ascii_lowercase + string.ascii_uppercase


class PathStar(Task):
    name = "pathstar"
    description = "path-star graphs: the path from the centre to a named leaf"
    answer_checked = False       # the response is checked (grid: "aeg", chat: "a e g"); the bare letters could be
                                 # a word of the chat prompt ("to", "the") and say nothing about a leak
    knobs = (Knob("degree", 3, 2, 25, "arms of the star"),
             Knob("length", 5, 2, 26, "nodes of an arm counted from the centre (centre included): the path's length"))

    def check_knob(self, knob):
        nodes = knob["degree"] * (knob["length"] - 1) + 1
        if nodes > len(LABELS):
            raise TaskError(f"pathstar: degree x (length - 1) + 1 = {nodes} nodes, more than the {len(LABELS)} letters "
                            f"that name them: lower degree or length")

    def generate(self, knob, rng, accept=None):
        d, m = knob["degree"], knob["length"]
        names = rng.sample(LABELS, d * (m - 1) + 1)
        start, arms = names[0], [names[1 + i * (m - 1):1 + (i + 1) * (m - 1)] for i in range(d)]
        goal_arm = rng.randrange(d)
        path = start + "".join(arms[goal_arm])
        if accept is not None and not accept(path):
            return None
        edges = [u + v for arm in arms for u, v in zip([start] + arm[:-1], arm)]
        rng.shuffle(edges)
        key = ",".join(sorted(edges)) + f"|{start}{path[-1]}"
        return Problem(self.name, dict(knob), {"edges": edges, "start": start, "goal": path[-1]}, path, key, path)

    def verify(self, problem, text):
        q = problem.question
        nodes = [ch for ch in text if ch in LABELS]
        edges = set(q["edges"])
        return (len(nodes) >= 2 and nodes[0] == q["start"] and nodes[-1] == q["goal"]
                and all(u + v in edges for u, v in zip(nodes, nodes[1:])))

    def grid_prompt(self, problem):
        q = problem.question
        return ",".join(q["edges"]) + f"|{q['start']}{q['goal']}"

    def grid_answer(self, problem):
        return problem.answer

    def chat_prompt(self, problem):
        q = problem.question
        edges = ", ".join(f"{e[0]}->{e[1]}" for e in q["edges"])
        return (f"A directed graph has the edges {edges}. Find the path from {q['start']} to {q['goal']}. Answer with "
                f"the nodes of the path separated by spaces.")

    def chat_response(self, problem):
        return " ".join(problem.answer)

    def layout(self, knob):
        e = knob["degree"] * (knob["length"] - 1)
        return 3 * e - 1 + 3, knob["length"]


PATHSTAR = PathStar()

__all__ = ["PathStar", "PATHSTAR", "LABELS"]
