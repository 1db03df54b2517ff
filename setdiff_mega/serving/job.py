"""One generation being served: its prompt, options, the text that became final, and its events.

A job decodes in a row of one of the scheduler's decodes (:mod:`.sessions`); after every decode step the
sampler's :class:`~setdiff_mega.decoding.base.DecodeState` is shown to :meth:`Job.observe`, which finds the tokens that
can no longer change and emits the new text. With the row's generation region starting at g, its leftmost
still-masked position f and its end e (set once the row is done):

    final tokens (row decoding)  = the committed generated tokens at positions [g, f)   (contiguous: never
                                   rewritten by a later step; an EOS there that could end the row has already
                                   ended it in the same step)
    final tokens (row done)      = the sampler's output (up to e, MASK dropped)

With the truncating criteria (``stop_confidence``, ``stop_entropy``) a later check may cut the output inside
that prefix, so such jobs emit their text only when done. Text = decode(final tokens), a final EOS dropped;
while decoding, each step's new final tokens are detokenized incrementally (the tokenizers library's
``DecodeStream``: the cost is the new tokens', not the whole text's; a tokenizer without one decodes the whole
prefix), and the last max(len(stop)) - 1 characters and a trailing incomplete character (U+FFFD) are held
back, so emitted text never has to be taken back. A stop string in the text ends the job there (OpenAI
semantics: the earliest occurrence of any stop string, excluded). Events go to ``emit`` (thread-safe; the
HTTP side's queue): ``("delta", text)`` (and, for a traced job, ``("trace", step)`` after every step: the
positions, tokens, texts and confidences it committed; the first also the generation ``region``), then
``("done", info)`` or ``("error", (status, message))``.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from setdiff_mega.decoding.base import GenerationConfig

_keys = itertools.count()


@dataclass
class Job:
    ids: list[int]                        # prompt token ids (BOS first; MASK positions for infilling)
    config: GenerationConfig
    emit: object                          # callable(event, payload), thread-safe
    stops: tuple = ()                     # stop strings (text ends before the earliest occurrence)
    timeout: float | None = None          # seconds from arrival
    tokenizer: object = None
    key: int = field(default_factory=lambda: next(_keys))
    client: str = ""                      # who sent it (fair admission: one FIFO per client, .bounded.FairQueue)
    arrival: float = field(default_factory=time.monotonic)
    started: float | None = None          # admitted into the batch
    first_token: float | None = None      # first text emitted
    finished: float | None = None
    tokens: list = field(default_factory=list)   # final generated tokens so far
    text: str = ""                        # text emitted so far
    steps: int = 0                        # decode steps that committed tokens
    committed_last: int = 0               # tokens committed by the last step
    _stream: object = None                # incremental detokenizer of the final tokens (tokenizers' DecodeStream)
    _full: str = ""                       # its text so far
    reason: str | None = None             # why it ended early: "stop", "timeout", "cancelled"
    cancelled: bool = False               # asked to stop (client gone, timeout): its decoder retires it
    done: bool = False
    trace: bool = False                   # emit ("trace", step's commits) after every step; the whole trace at the end
    trace_record: dict | None = None      # the whole trace (decoding/trace.py), set by the decode before finish
    trace_started: bool = False           # its first trace event (with the generation region) was emitted

    @property
    def deadline(self) -> float | None:
        return None if self.timeout is None else self.arrival + self.timeout

    @property
    def streams_early(self) -> bool:
        return self.config.stop_confidence is None and self.config.stop_entropy is None

    def _holdback(self) -> int:
        return max((len(s) for s in self.stops), default=1) - 1

    def _text(self, ids: list[int]) -> str:
        if ids and ids[-1] == self.tokenizer.eos:
            ids = ids[:-1]
        return self.tokenizer.decode(ids)

    def _cut(self, text: str) -> tuple[str, bool]:
        """``text`` before the earliest stop string, and whether one occurred."""
        hits = [text.find(s) for s in self.stops if s and s in text]
        return (text[:min(hits)], True) if hits else (text, False)

    def _advance(self, text: str) -> None:
        if text.startswith(self.text) and len(text) > len(self.text):
            delta, self.text = text[len(self.text):], text
            if self.first_token is None:
                self.first_token = time.monotonic()
            self.emit("delta", delta)

    @property
    def streaming(self) -> bool:
        """Whether new final tokens may be emitted now (streams early, not stopped)."""
        return self.streams_early and self.reason is None and not self.done

    def _decoded(self, new: list[int]) -> str:
        """The text of all final tokens after ``new`` joined them (incrementally where the tokenizer allows)."""
        hf = getattr(self.tokenizer, "hf", None)
        if hf is None:
            return self.tokenizer.decode(self.tokens)
        if self._stream is None:
            from tokenizers.decoders import DecodeStream

            self._stream, self._full = DecodeStream(skip_special_tokens=False), ""
        chunk = self._stream.step(hf, new)
        if chunk:
            self._full += chunk
        return self._full

    def extend(self, new: list[int]) -> bool:
        """After a decode step (the scheduler loop): ``new`` tokens became final; emit the text that can no longer
        change; True when a stop string ended the text."""
        if not new or not self.streaming:
            return False
        self.tokens = self.tokens + new
        text, hit = self._cut(self._decoded(new))
        if hit:
            self.reason = "stop"
            self._advance(text)
            return True
        keep = len(text) - self._holdback()
        safe = text[:max(keep, 0)].rstrip("\ufffd")
        self._advance(safe)
        return False

    def finish(self, out=None) -> dict:
        """The job's end (sampler output, or None when cut short): emit the rest of the text and the summary."""
        if out is not None and self.reason is None:
            self.tokens = list(out.tokens[0])
            text, hit = self._cut(self._text(self.tokens))
            self._advance(text)
            eos = bool(self.tokens) and self.tokens[-1] == self.tokenizer.eos
            self.reason = "stop" if hit or eos or len(self.tokens) < self.config.max_new_tokens else "length"
        self.finished = time.monotonic()
        self.done = True
        info = {"finish_reason": self.reason, "text": self.text, "token_ids": list(self.tokens),
                "prompt_tokens": len(self.ids), "completion_tokens": len(self.tokens), "steps": self.steps}
        if self.trace_record is not None:
            info["trace"] = self.trace_record
        self.emit("done", info)
        return info

    def fail(self, status: int, message: str) -> None:
        self.finished = time.monotonic()
        self.done = True
        self.emit("error", (status, message))


__all__ = ["Job"]
