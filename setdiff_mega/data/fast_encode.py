"""Exact, faster encoding for byte-level BPE tokenizers: GPT-2 pre-tokenization in Python + a word cache.

For short documents the HF tokenizer spends most of its time in its pre-tokenizer (regex split, byte
mapping, offset tracking), not in BPE. This encoder splits the text with the same GPT-2 pattern

    's|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+

and memoises word -> ids (natural text is Zipfian, so almost every word is a cache hit), calling the
tokenizer only for unseen words. It is used only where it is provably identical to
``tokenizer.encode(text, add_special_tokens=False)``:

* the tokenizer has no normalizer, a ByteLevel pre-tokenizer with ``use_regex=True`` and
  ``add_prefix_space=False``, and a BPE model (otherwise every call falls back to the tokenizer);
* the document is printable ASCII plus tab / newline / CR (where every regex engine agrees on letters,
  digits and whitespace) and contains no added-token string (HF splits those out first).

Other documents go through the tokenizer unchanged. One in ``verify_every`` fast-path documents is also
encoded the slow way and compared; a mismatch disables the fast path for the rest of the run.
"""
from __future__ import annotations

import json
import re

_GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_UNSAFE = re.compile(r"[^\t\n\r\x20-\x7e]")


class FastEncoder:
    def __init__(self, tokenizer, max_cache: int = 1 << 20, verify_every: int = 64):
        self.tok = tokenizer
        self.cache: dict[str, list[int]] = {}
        self.max_cache = max_cache
        self.verify_every = verify_every
        self.count = 0
        self.fast_docs = self.slow_docs = 0
        self.enabled = self._eligible()
        self.pattern = None
        self.special = None
        if self.enabled:
            import regex  # gated: the exact encoder runs only where `regex` imports (_eligible)

            self.pattern = regex.compile(_GPT2_PATTERN)
            added = [t.content for t in tokenizer.hf.get_added_tokens_decoder().values()]
            self.special = re.compile("|".join(re.escape(a) for a in sorted(added, key=len, reverse=True))) \
                if added else None

    def _eligible(self) -> bool:
        try:
            import regex  # noqa: F401
        except ImportError:
            return False
        cfg = json.loads(self.tok.hf.to_str())
        pre = cfg.get("pre_tokenizer") or {}
        return (cfg.get("normalizer") is None and pre.get("type") == "ByteLevel" and pre.get("use_regex", True)
                and not pre.get("add_prefix_space", False) and (cfg.get("model") or {}).get("type") == "BPE")

    def slow(self, text: str) -> list[int]:
        return self.tok.hf.encode(text, add_special_tokens=False).ids

    def encode(self, text: str) -> list[int]:
        if not self.enabled or _UNSAFE.search(text) or (self.special is not None and self.special.search(text)):
            self.slow_docs += 1
            return self.slow(text)
        cache = self.cache
        ids: list[int] = []
        for w in self.pattern.findall(text):
            r = cache.get(w)
            if r is None:
                r = self.slow(w)
                if len(cache) >= self.max_cache:
                    cache.clear()
                cache[w] = r
            ids.extend(r)
        self.fast_docs += 1
        self.count += 1
        if self.verify_every and self.count % self.verify_every == 0:
            ref = self.slow(text)
            if ref != ids:                      # never expected; stay exact if it ever happens
                self.enabled = False
                return ref
        return ids


    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of several documents: the exact fast path when eligible, else the tokenizer's batch call."""
        return [self.encode(t) for t in texts] if self.enabled else self.tok.encode_batch(texts)


__all__ = ["FastEncoder"]
