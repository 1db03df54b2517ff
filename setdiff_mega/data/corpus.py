"""Embedded, deterministic corpora whose tasks can be scored exactly, plus readers for local text.

* **Math word problems** (GSM8K-like): 2-4 step arithmetic stories with a worked solution, one
  equation per step, and a final ``#### <answer>`` line. Fields: question, solution, answer.
* **Stories** (ROCStories-like): five templated sentences with a coherent goal / attempt / outcome,
  usable for infilling (mask sentence 3, or 2-4). Fields: sentences (list of 5).
* **Arithmetic** (``task="arith"``, the learnable math level): one step (``a + b``, ``a - b``) or two
  steps (``a + b = s``, then ``s - c``) on small numbers (a <= 20, b, c <= 9) with the worked steps and
  ``#### <answer>``, in the math format. A few-million-parameter model learns it on 2 CPU cores in
  minutes without saturating it (the two-step problems stay hard). Fields: question, solution, answer.
* **Quests** (``task="quest"``, the suffix-dependent infilling task, the paper's infill-3 layout):
  sentence 1 introduces a person (name, role, place: drawn independently of the rest), sentences 2-4
  tell the plan, the attempt with its problem and the fix, sentence 5 the outcome. Sentences 2-4 are a
  function of the goal alone (no name or pronoun: filling them needs no copying from the prefix), and
  the goal is named by sentence 5 alone: masking 2-4, a model that sees sentence 5 can fill them
  exactly; one that sees only sentence 1 can only guess the goal (1 in 8). Fields: sentences (list of
  5), goal (index).

Every document is a dict with ``text`` (what is tokenized) and ``task`` plus the task fields. The same
seed always yields the same corpus. Readers: ``.jsonl`` (one JSON object per line, ``json_key``
field) and plain text (documents separated by a blank line).
"""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Iterator

from .indexed import DataError
from .records import as_text, document, utf8_error

NAMES = ["Ava", "Ben", "Chloe", "Dan", "Emma", "Finn", "Grace", "Hugo", "Iris", "Jack", "Kara", "Leo",
         "Maya", "Noah", "Olive", "Paul", "Quinn", "Rosa", "Sam", "Tara", "Uma", "Victor", "Wendy", "Yara"]
ITEMS = ["apples", "marbles", "stickers", "books", "coins", "pencils", "cookies", "shells", "cards",
         "stamps", "beads", "flowers"]
PRONOUN = {n: ("she" if n in {"Ava", "Chloe", "Emma", "Grace", "Iris", "Kara", "Maya", "Olive", "Rosa",
                              "Tara", "Uma", "Wendy", "Yara"} else "he") for n in NAMES}


def _math_problem(rng: random.Random) -> dict:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    value = rng.randint(3, 40)
    q = [f"{name} has {value} {item}."]
    sol = [f"{name} starts with {value} {item}."]
    for _ in range(rng.randint(2, 4)):
        kind = rng.choice(["add", "add", "sub", "sub", "mul", "div"])
        if kind == "add":
            n = rng.randint(2, 30)
            verb = rng.choice(["buys", "finds", "receives", "wins"])
            q.append(f"Then {PRONOUN[name]} {verb} {n} more.")
            sol.append(f"After that {PRONOUN[name]} has {value} + {n} = {value + n}.")
            value += n
        elif kind == "sub" and value > 2:
            n = rng.randint(1, value - 1)
            verb = rng.choice(["gives away", "loses", "uses", "sells"])
            q.append(f"Then {PRONOUN[name]} {verb} {n} of them.")
            sol.append(f"After that {PRONOUN[name]} has {value} - {n} = {value - n}.")
            value -= n
        elif kind == "mul" and value <= 60:
            n = rng.randint(2, 4)
            word = {2: "doubles", 3: "triples", 4: "quadruples"}[n]
            q.append(f"Then {PRONOUN[name]} {word} the number of {item}.")
            sol.append(f"After that {PRONOUN[name]} has {value} * {n} = {value * n}.")
            value *= n
        else:
            divisors = [d for d in (2, 3, 4, 5) if value % d == 0 and value // d >= 1]
            if not divisors:
                n = rng.randint(2, 20)
                q.append(f"Then {PRONOUN[name]} gets {n} more.")
                sol.append(f"After that {PRONOUN[name]} has {value} + {n} = {value + n}.")
                value += n
                continue
            d = rng.choice(divisors)
            q.append(f"Then {PRONOUN[name]} splits them into {d} equal groups and keeps one group.")
            sol.append(f"After that {PRONOUN[name]} has {value} / {d} = {value // d}.")
            value //= d
    q.append(f"How many {item} does {name} have now?")
    question, solution = " ".join(q), " ".join(sol)
    text = f"Question: {question}\nAnswer: {solution}\n#### {value}"
    return {"task": "math", "text": text, "question": question, "solution": solution, "answer": str(value)}


PLACES = ["a small village", "a busy city", "a quiet farm", "a seaside town", "a mountain cabin", "a big house"]
ROLES = ["student", "baker", "painter", "farmer", "teacher", "musician", "gardener", "runner"]
GOALS = [
    ("bake a cake for a friend", "bought flour, eggs and sugar at the market",
     "the oven broke halfway through", "fixed the oven", "baked a delicious cake", "proud"),
    ("win the town race", "trained every morning for a month",
     "a sprained ankle slowed the training", "found a good coach", "crossed the finish line first", "thrilled"),
    ("grow tomatoes in the garden", "planted seeds in neat rows",
     "a week without rain dried the soil", "carried water from the well", "picked a basket of red tomatoes", "happy"),
    ("learn to play the piano", "practised scales every evening",
     "the hardest song seemed impossible", "found a patient teacher", "played the song at a concert", "delighted"),
    ("paint a picture of the sea", "set up an easel on the beach",
     "the wind kept knocking the easel over", "tied the easel to a rock", "finished a bright painting", "calm"),
    ("build a treehouse", "collected wooden boards and nails",
     "the first floor was crooked", "asked a neighbour for help", "climbed into a sturdy treehouse", "excited"),
    ("find a lost dog", "put up posters around town",
     "nobody called for two days", "searched the park at dawn", "hugged the muddy dog", "relieved"),
    ("write a short book", "wrote a page every night",
     "the story got stuck in the middle", "talked the plot over with a friend", "held the printed book", "proud"),
]
FRIENDS = ["an old friend", "a kind neighbour", "a younger cousin", "a classmate", "a grandparent"]


def _story(rng: random.Random) -> dict:
    name, place, role = rng.choice(NAMES), rng.choice(PLACES), rng.choice(ROLES)
    goal, attempt, problem, fix, outcome, feeling = rng.choice(GOALS)
    pron = PRONOUN[name]
    friend = rng.choice(FRIENDS)
    when = rng.choice(["One spring", "One summer", "One autumn", "One winter", "One day"])
    sents = [
        f"{name} was a {role} who lived in {place}.",
        f"{when}, {pron} decided to {goal}.",
        f"First {pron} {attempt}, but {problem}.",
        f"With help from {friend}, {name} {fix}.",
        f"In the end {pron} {outcome} and felt {feeling}.",
    ]
    return {"task": "story", "text": " ".join(sents), "sentences": sents}


def _arith_problem(rng: random.Random) -> dict:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    pron = PRONOUN[name]
    a, b = rng.randint(2, 20), rng.randint(1, 9)
    if rng.random() < 0.5:                                   # one step
        if rng.random() < 0.5 or b >= a:
            q = f"{name} has {a} {item}. {pron.capitalize()} {rng.choice(['buys', 'finds', 'gets'])} {b} more."
            value, sol = a + b, f"{a} + {b} = {a + b}."
        else:
            q = f"{name} has {a} {item}. {pron.capitalize()} {rng.choice(['loses', 'sells', 'uses'])} {b} of them."
            value, sol = a - b, f"{a} - {b} = {a - b}."
    else:                                                    # two steps: add, then take away
        s = a + b
        c = rng.randint(1, min(9, s - 1))
        q = (f"{name} has {a} {item}. {pron.capitalize()} {rng.choice(['buys', 'finds', 'gets'])} {b} more. "
             f"Then {pron} {rng.choice(['loses', 'sells', 'uses'])} {c} of them.")
        value, sol = s - c, f"{a} + {b} = {s}. {s} - {c} = {s - c}."
    question = f"{q} How many {item} does {name} have now?"
    text = f"Question: {question}\nAnswer: {sol}\n#### {value}"
    return {"task": "arith", "text": text, "question": question, "solution": sol, "answer": str(value)}


def arith_problems(n: int, seed: int) -> list[dict]:
    """``n`` arithmetic problems (:func:`_arith_problem`) from a stream of their own (seed ``seed``)."""
    rng = random.Random(seed)
    return [_arith_problem(rng) for _ in range(n)]


def _quest(rng: random.Random) -> dict:
    name, place, role = rng.choice(NAMES), rng.choice(PLACES), rng.choice(ROLES)
    g = rng.randrange(len(GOALS))
    goal, attempt, problem, fix, outcome, feeling = GOALS[g]
    pron = PRONOUN[name]
    sents = [
        f"This is a story about {name}, a {role} from {place}.",
        f"The plan was to {goal}.",
        f"Our hero {attempt}, but {problem}.",
        f"Then our hero {fix}.",
        f"At last {pron} {outcome} and was {feeling}.",
    ]
    return {"task": "quest", "text": " ".join(sents), "sentences": sents, "goal": g}


CORPUS_VERSION = 3          # bump when a generator changes: prepared corpora are rebuilt, not reused


def corpus_counts(num_math: int, num_stories: int, num_arith: int | None = None,
                  num_quests: int | None = None) -> dict:
    """Documents per task, with the defaults of the two new tasks filled in."""
    return {"num_math": num_math, "num_stories": num_stories,
            "num_arith": num_math if num_arith is None else num_arith,
            "num_quests": num_stories * 2 // 3 if num_quests is None else num_quests}


def embedded_corpus(num_math: int = 12000, num_stories: int = 12000, seed: int = 0, num_arith: int | None = None,
                    num_quests: int | None = None) -> list[dict]:
    """The deterministic default corpus, every task interleaved (``num_arith`` defaults to ``num_math``,
    ``num_quests`` to 2/3 of ``num_stories``). The math and story documents are those of version 1 (same
    draws, same order of draws); arithmetic and quests come from their own random stream."""
    num_math, num_stories, num_arith, num_quests = corpus_counts(num_math, num_stories, num_arith, num_quests).values()
    rng = random.Random(seed)
    docs = [_math_problem(rng) for _ in range(num_math)] + [_story(rng) for _ in range(num_stories)]
    extra = random.Random(seed + 2)
    docs += [_arith_problem(extra) for _ in range(num_arith)] + [_quest(extra) for _ in range(num_quests)]
    random.Random(seed + 1).shuffle(docs)
    return docs


def split_heldout(docs: list[dict], per_task: int) -> tuple[dict, list[dict]]:
    """({task: the first ``per_task`` documents of that task}, the training documents): a training
    document whose text equals a held-out one is dropped, so no task example is seen in training."""
    held: dict = {}
    for d in docs:
        rows = held.setdefault(d["task"], [])
        if len(rows) < per_task:
            rows.append(d)
    texts = {d["text"] for rows in held.values() for d in rows}
    return held, [d for d in docs if d["text"] not in texts]


def read_documents(path: str | Path, json_key: str = "text") -> Iterator[str]:
    """Yield documents from a .jsonl (field ``json_key``; the value rules of :mod:`.records`, a list of
    sentences concatenated) or plain-text file (blank-line separated); errors name the file and line."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"input file '{p}' does not exist")
    data = p.read_bytes()
    if p.suffix in (".jsonl", ".json"):
        for lineno, line in enumerate(data.split(b"\n"), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except UnicodeDecodeError as e:
                raise utf8_error(f"{p}:{lineno}", line, e) from None
            except json.JSONDecodeError as e:
                raise DataError(f"{p}:{lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
            yield as_text(document(obj, [json_key], f"{p}:{lineno}"))
        return
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        start = data.rfind(b"\n", 0, e.start) + 1
        lineno = data.count(b"\n", 0, e.start) + 1
        line = data[start:]
        raise utf8_error(f"{p}:{lineno}", line,
                         UnicodeDecodeError(e.encoding, line, e.start - start, e.end - start, e.reason)) from None
    block: list[str] = []
    for line in text.splitlines():
        if line.strip():
            block.append(line)
        elif block:
            yield "\n".join(block)
            block = []
    if block:
        yield "\n".join(block)


def write_jsonl(docs: list[dict], path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps(d, ensure_ascii=False) + "\n")


__all__ = ["embedded_corpus", "corpus_counts", "split_heldout", "read_documents", "write_jsonl", "CORPUS_VERSION",
           "arith_problems"]
