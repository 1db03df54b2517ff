"""Stopping criteria, checked on the decoded prefix of every row (method.md 5.3, P14).

The samplers call :class:`StopCriteria` at their own cadence (SetDLM: after step i for i > 0 and
i % W == 0; AR: every step; BD3LM / MDLM: when a block is complete) with ``limit`` [B], the end of the
prefix to examine (SetDLM: the new leftmost masked position + W). A row whose criterion fires is
retired with its output ending at ``end`` (= ``limit``, as the reference truncates at
``window_start + W``, or earlier for the confidence / entropy criteria, which truncate themselves).
Infill rows are never stopped (the reference has no criterion for infilling).

Criteria (each off unless configured), with the reference's classes:

* ``stop_strings``: a string occurs in the decoded generation (MASK dropped).
* ``stop_regex`` with ``stop_regex_count`` n (``RegexStoppingCriteria``): at least n matches in the decoded
  prompt + generation of [0, limit), matches containing the MASK token ignored (GSM8K: two
  ``\\boxed{...}``, the prompt holds one). Matched by RE2 (:func:`compile_stop_regex`), in time linear in
  the text for a pattern of bounded size: a pattern is client input on the server, and Python's ``re``
  backtracks exponentially on some (``(a+)+$`` on 27 a's and a '!' took 16 s, every extra character
  doubling it). RE2's syntax is Python's but for what needs backtracking: no backreferences (``\\1``), no
  lookaround (``(?=``, ``(?!``, ``(?<=``, ``(?<!``), no possessive or atomic groups, ``\\Z`` written ``\\z``;
  such a pattern is refused with one line. Matches are leftmost-first, as ``re``'s (not POSIX longest).
  RE2 (google-re2) is optional here, as this package is the remote code of every export: without it (an export
  loaded where it is not installed) patterns run on Python's ``re``, after a one-line warning the first time;
  the export runs its user's own patterns locally, while the server (google-re2 a dependency) keeps RE2.
* ``stop_repeat`` N (``RepeatingTokenStoppingCriteria``): the N tokens ending at the last non-MASK
  token of [0, limit) are identical.
* ``stop_confidence`` c with ``stop_patience`` k (``EntropyEosStoppingCriteria`` confidence part): the
  confidences of the committed generated tokens are examined once each, in position order within
  every check, after skipping the first ``min_new_tokens`` examined; k consecutive ones below c stop
  the row, its output ending after the k-th (strike counts carry over between checks).
* ``stop_entropy`` h over ``stop_entropy_window`` w (its entropy part): once limit >= w and at least
  ``min_new_tokens`` tokens were generated, the entropy (nats) of the token histogram of the last w
  positions (MASK excluded) below h stops the row, truncated at max(limit - w, start + min_new_tokens).

The reference counts the prompt towards ``confidence_min_tokens`` (its ``ignore_prompt_eos=false``);
``min_new_tokens`` here counts generated tokens only. Per-row decoding is used only for the text
criteria; the others are batched tensor operations.
"""
from __future__ import annotations

import logging
import re

import torch

try:
    import re2
except ImportError:             # an export loaded without google-re2: Python's re (compile_stop_regex)
    re2 = None

log = logging.getLogger(__name__)
_warned = False                 # the fallback's warning was given (once per process)

MAX_PATTERN_CHARS = 1000        # a stop_regex's length
MAX_PROGRAM = 1000              # the instructions of its compiled RE2 program: matching costs at most
                                # (text length) x (program size); measured on 20,000 characters of a
                                # hostile text at this size: under 0.1 s a match, most patterns far less


def compile_stop_regex(pattern: str):
    """``pattern`` compiled by RE2 (module docstring), or a one-line ValueError: too long, a syntax RE2 lacks
    (backreferences, lookaround) or a program larger than :data:`MAX_PROGRAM`. The compiled object is not
    shared through the ``re2`` module's own cache (128 patterns of up to 8 MiB each, keyed by client text)."""
    if not isinstance(pattern, str):
        raise ValueError(f"stop_regex must be a string, got {type(pattern).__name__}")
    if len(pattern) > MAX_PATTERN_CHARS:
        raise ValueError(f"stop_regex has {len(pattern)} characters, more than the limit of {MAX_PATTERN_CHARS}")
    if re2 is None:
        return _compile_re(pattern)
    options = re2.Options()
    options.log_errors = False                  # RE2's own stderr line per refused pattern
    try:
        compiled = re2._Regexp(pattern, options)     # the constructor behind re2.compile, without its cache
    except re2.error as e:
        why = e.args[0].decode(errors="replace") if e.args and isinstance(e.args[0], bytes) else str(e)
        raise ValueError(f"stop_regex={pattern[:80]!r} is not supported by RE2, the linear-time engine stop "
                         f"patterns run on ({why}); backreferences and lookaround are not available") from None
    size = compiled._regexp.ProgramSize()
    if size > MAX_PROGRAM:
        raise ValueError(f"stop_regex={pattern[:80]!r} compiles to {size} RE2 instructions, more than the limit "
                         f"of {MAX_PROGRAM} (large counted repetitions such as {{1000}} cost the most); simplify it")
    return compiled


def _compile_re(pattern: str):
    """``pattern`` compiled by Python's ``re`` where google-re2 is not installed (module docstring): one warning
    the first time; a pattern ``re`` cannot compile is a one-line ValueError."""
    global _warned
    if not _warned:
        _warned = True
        log.warning("google-re2 is not installed: stop_regex runs on Python's re, which may take exponential time "
                    "on some patterns (pip install google-re2 for the linear-time engine)")
    try:
        return re.compile(pattern)
    except re.error as e:
        raise ValueError(f"stop_regex={pattern[:80]!r} is not a regular expression ({e})") from None


def _last_true(sel: torch.Tensor) -> torch.Tensor:
    """[B, N] bool -> [B] index of the last True (-1 if none)."""
    pos = torch.arange(sel.shape[1], device=sel.device)
    return torch.where(sel, pos, torch.full_like(pos, -1)).max(1).values


class StopCriteria:
    def __init__(self, cfg, tokenizer, canvas, mask_id: int):
        self.cfg, self.tok, self.canvas, self.mask_id = cfg, tokenizer, canvas, mask_id
        self.regex = compile_stop_regex(cfg.stop_regex) if cfg.stop_regex else None
        text = bool(cfg.stop_strings) or self.regex is not None
        if text and tokenizer is None:
            raise ValueError("stop strings / stop_regex need the tokenizer (pass tokenizer= to the sampler)")
        self.enabled = text or cfg.stop_repeat > 0 or cfg.stop_confidence is not None or cfg.stop_entropy is not None
        B, N = canvas.tokens.shape
        dev = canvas.tokens.device
        self.pos = torch.arange(N, device=dev)
        self.start = torch.where(canvas.generate, self.pos, torch.full_like(self.pos, N)).min(1).values
        self.strikes = torch.zeros(B, dtype=torch.long, device=dev)
        self.seen = torch.zeros(B, dtype=torch.long, device=dev)
        self.checked = torch.zeros(B, N, dtype=torch.bool, device=dev)

    def reset_row(self, b: int) -> None:
        """Row ``b`` holds a new request (the canvas row was rewritten): its counters start again."""
        N = self.pos.shape[0]
        self.start[b] = torch.where(self.canvas.generate[b], self.pos, torch.full_like(self.pos, N)).min()
        self.strikes[b] = 0
        self.seen[b] = 0
        self.checked[b] = False

    def __call__(self, tokens, masked, conf, done, limit) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (fired [B], end [B]) for rows not done and not infilling."""
        cv = self.canvas
        limit = limit.clamp(max=tokens.shape[1])
        live = ~done & ~cv.infill
        fired = torch.zeros_like(live)
        end = limit.clone()
        if not self.enabled or not bool(live.any()):
            return fired, end
        inside = cv.valid & (self.pos[None] < limit[:, None])
        if self.regex is not None or self.cfg.stop_strings:
            fired |= self._text(tokens, masked, inside, live)
        if self.cfg.stop_repeat > 0:
            fired |= self._repeat(tokens, masked, inside)
        own = torch.zeros_like(live)
        if self.cfg.stop_confidence is not None:
            hit, at = self._confidence(masked, conf, inside, live)
            own, end = hit, torch.where(hit, at, end)
        if self.cfg.stop_entropy is not None:
            hit = self._entropy(tokens, masked, inside, limit) & ~own
            cut = torch.maximum(limit - self.cfg.stop_entropy_window, self.start + self.cfg.min_new_tokens)
            end = torch.where(hit, cut.clamp(max=limit), end)
            own |= hit
        fired = (fired | own) & live
        return fired, torch.where(fired, end, limit)

    def _text(self, tokens, masked, inside, live):
        cv, out = self.canvas, torch.zeros_like(live)
        mask_text = self.tok.token(self.mask_id) if self.regex is not None else None
        for b in live.nonzero().flatten().tolist():
            if self.cfg.stop_strings:
                gen = inside[b] & cv.generate[b] & ~masked[b]
                text = self.tok.decode(tokens[b][gen].tolist())
                if any(s in text for s in self.cfg.stop_strings):
                    out[b] = True
                    continue
            if self.regex is not None:
                text = self.tok.decode(tokens[b][inside[b]].tolist())     # prompt + generation, MASK kept
                hits = 0
                for m in self.regex.finditer(text):
                    hits += mask_text not in m.group(0)
                    if hits >= self.cfg.stop_regex_count:      # enough: the rest of the text is not searched
                        break
                out[b] = hits >= self.cfg.stop_regex_count
        return out

    def _repeat(self, tokens, masked, inside):
        n = self.cfg.stop_repeat
        last = _last_true(inside & ~masked)                              # last non-MASK token of the prefix
        idx = (last[:, None] - n + 1 + torch.arange(n, device=last.device)[None]).clamp(min=0)
        window = tokens.gather(1, idx)
        same = (window == tokens.gather(1, last.clamp(min=0)[:, None])) & ~masked.gather(1, idx)
        return same.all(1) & (last - n + 1 >= 0)

    def _confidence(self, masked, conf, inside, live):
        """Consecutive low-confidence run over newly examined positions (vectorised strike counter)."""
        cfg = self.cfg
        new = inside & self.canvas.generate & ~masked & ~self.checked & live[:, None]
        self.checked |= new
        n_new = new.sum(1)
        M = int(n_new.max())
        if M == 0:
            return torch.zeros_like(live), torch.zeros_like(self.seen)
        key = torch.where(new, self.pos[None], self.pos[None] + new.shape[1])
        idx = key.argsort(1)[:, :M]                                      # new positions, ascending
        m = torch.arange(M, device=idx.device)[None]
        skip = (cfg.min_new_tokens - self.seen).clamp(min=0)            # still inside the minimum length
        carry = torch.where((skip > 0) & (n_new > 0), torch.zeros_like(self.strikes), self.strikes)
        self.seen += n_new
        valid = (m < n_new[:, None]) & (m >= skip[:, None])
        low = valid & (conf.gather(1, idx) < cfg.stop_confidence)
        brk = torch.where(valid & ~low, m, torch.full_like(m, -1)).cummax(1).values     # last reset so far
        run = torch.where(brk >= 0, m - brk, m - skip[:, None] + 1 + carry[:, None]) * low
        hit = run >= cfg.stop_patience
        first = torch.where(hit, m, torch.full_like(m, M)).min(1).values.clamp(max=M - 1)
        at = idx.gather(1, first[:, None])[:, 0] + 1
        last = torch.where(valid, m, torch.full_like(m, -1)).max(1).values
        self.strikes = torch.where(last >= 0, run.gather(1, last.clamp(min=0)[:, None])[:, 0], carry)
        return hit.any(1), at

    def _entropy(self, tokens, masked, inside, limit):
        cfg, w = self.cfg, self.cfg.stop_entropy_window
        lo = (limit - w).clamp(min=0)
        sel = inside & ~masked & (self.pos[None] >= lo[:, None])
        V = int(tokens.max()) + 1
        counts = torch.zeros(tokens.shape[0], V, device=tokens.device).scatter_add_(1, tokens, sel.float())
        p = counts / counts.sum(1, keepdim=True).clamp(min=1)
        ent = torch.special.entr(p).sum(1)
        ready = (limit >= w) & (limit - self.start >= cfg.min_new_tokens)
        return ready & (ent < cfg.stop_entropy)


__all__ = ["StopCriteria", "compile_stop_regex", "MAX_PATTERN_CHARS", "MAX_PROGRAM"]
