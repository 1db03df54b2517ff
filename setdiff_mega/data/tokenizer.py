"""Byte-level BPE tokenizer (HF ``tokenizers``) with the project's special tokens.

Special tokens: ``<|bos|>``, ``<|eos|>`` (also the end-of-document token, ``eod``), ``<|pad|>`` and
``<|mask|>`` (the diffusion MASK class; never a target). Byte-level means every string round-trips:
``decode(encode(s)) == s``. The object also satisfies megatron-core's dataset-tokenizer duck type
(``vocab_size``, ``eod``, ``pad``, ``unique_identifiers``).
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Iterable

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = {"bos": "<|bos|>", "eos": "<|eos|>", "pad": "<|pad|>", "mask": "<|mask|>"}


class Tokenizer:
    """Thin wrapper over a ``tokenizers.Tokenizer`` that knows the special ids."""

    def __init__(self, hf: HFTokenizer, source: str = "<memory>"):
        self.hf = hf
        self.source = source
        missing = [t for t in SPECIAL_TOKENS.values() if hf.token_to_id(t) is None]
        if missing:
            raise ValueError(f"tokenizer '{source}' lacks the special tokens {missing}; "
                             f"train it with setdiff_mega (tools/prepare_data.py) or add them")
        self.bos = hf.token_to_id(SPECIAL_TOKENS["bos"])
        self.eos = hf.token_to_id(SPECIAL_TOKENS["eos"])
        self.pad = hf.token_to_id(SPECIAL_TOKENS["pad"])
        self.mask = hf.token_to_id(SPECIAL_TOKENS["mask"])
        self.vocab_size = hf.get_vocab_size()
        self.hash = hashlib.sha256(hf.to_str().encode()).hexdigest()[:16]

    # megatron-core dataset protocol
    @property
    def eod(self) -> int:
        return self.eos

    @property
    def unique_identifiers(self) -> dict:
        return {"class": "setdiff_mega.Tokenizer", "hash": self.hash, "vocab_size": self.vocab_size}

    @property
    def special_ids(self) -> dict:
        return {"bos": self.bos, "eos": self.eos, "pad": self.pad, "mask": self.mask}

    @classmethod
    def from_file(cls, path: str | Path) -> "Tokenizer":
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"tokenizer file '{p}' does not exist; run tools/prepare_data.py first "
                                    f"or point data.tokenizer at a tokenizer.json")
        return cls(HFTokenizer.from_file(str(p)), source=str(p))

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int = 2048, min_frequency: int = 2) -> "Tokenizer":
        hf = HFTokenizer(models.BPE())
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        hf.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                      special_tokens=list(SPECIAL_TOKENS.values()),
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      show_progress=False)
        hf.train_from_iterator(texts, trainer=trainer)
        return cls(hf)

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.hf.save(str(path))

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.hf.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids, skip_special: bool = False) -> str:
        ids = [int(i) for i in ids]
        if skip_special:
            special = set(self.special_ids.values())
            ids = [i for i in ids if i not in special]
        return self.hf.decode(ids, skip_special_tokens=False)

    def token(self, i: int) -> str:
        return self.hf.id_to_token(int(i))


__all__ = ["Tokenizer", "SPECIAL_TOKENS"]
