"""The quests' diagnostics (experiments/paper/quest_probe.py): goals from the corpus, the goal token, one
decoded example's measurements, the per-model summary."""
import random

from experiments.paper import quest_probe as Q
from setdiff_mega.data.corpus import GOALS, _quest


class WordTokenizer:
    """One id per whitespace-separated word (a stand-in with the tokenizer's encode)."""

    def __init__(self):
        self.vocab: dict = {}

    def encode(self, text):
        return [self.vocab.setdefault(w, len(self.vocab)) for w in text.split()]


def test_middle_is_the_corpus_quests_sentences_two_to_four():
    rng = random.Random(3)
    for _ in range(20):
        q = _quest(rng)
        assert Q.middle(q["goal"]) == " ".join(q["sentences"][1:4])


def test_goal_token_is_the_first_where_goals_differ_and_names_are_unique():
    tok = WordTokenizer()
    assert Q.goal_position(tok) == 4                                          # "The plan was to" | goal
    for g in range(len(GOALS)):
        assert Q.named_goal("x " + Q.middle(g) + " y") == g
    assert Q.named_goal("The plan was to fly.") is None


def _record(tok, goal, text, steps, conf, ref_goal):
    ref = Q.middle(ref_goal)
    return {"generated": text, "correct": text == ref, "tokens": tok.encode(" " + text), "commit_steps": steps,
            "confidences": conf}, tok.encode(" " + ref)


def test_example_measures_first_commit_goal_token_and_named_goal():
    tok = WordTokenizer()
    text = Q.middle(2)
    m = len(tok.encode(text))
    steps = [5] * m
    steps[4], steps[m - 1] = 0, 1                       # the goal word first, then the last word
    conf = [0.5] * m
    conf[4] = 0.9
    rec, ref = _record(tok, 2, text, steps, conf, 2)
    ex = Q.example(rec, 2, 4, ref)
    assert ex["correct"] and ex["named"] == 2 and ex["first_offset"] == 4
    assert ex["first_relative"] == 4 / (m - 1) and ex["first_confidence"] == 0.9
    assert ex["goal_rank"] == 0 and ex["goal_confidence"] == 0.9 and ex["goal_token_right"]
    rec, ref = _record(tok, 5, Q.middle(5), list(range(m)), [0.7] * m, 2)     # left to right, the wrong goal
    ex = Q.example(rec, 2, 4, ref)
    assert not ex["correct"] and ex["named"] == 5 and ex["first_offset"] == 0 and ex["goal_rank"] == 4
    assert not ex["goal_token_right"]
    right, _ = _record(tok, 2, Q.middle(2), list(range(m)), [0.6] * m, 2)
    s = Q.summarise({"objective": "setdlm", "D": 4, "seed": 1}, "t", [Q.example(right, 2, 4, ref), ex])
    assert s["exact_match"] == 0.5 and s["goal_right"] == 0.5 and s["goal_wrong"] == 0.5 and s["goal_none"] == 0
    assert s["goal_token_right"] == 0.5 and s["exact_given_goal_right"] == 1.0
    assert s["goal_confidence_right"] == 0.6 and s["goal_confidence_wrong"] == 0.7
