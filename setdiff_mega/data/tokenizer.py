"""Byte-level BPE tokenizer (HF ``tokenizers``) with the project's special tokens.

Special tokens: ``<|bos|>``, ``<|eos|>`` (also the end-of-document token, ``eod``), ``<|pad|>`` and
``<|mask|>`` (the diffusion MASK class; never a target). An existing tokenizer.json can be adopted
(:meth:`Tokenizer.adopt`): missing role tokens are added and the roles recorded in a sidecar. Byte-level
means every string round-trips: ``decode(encode(s)) == s``. The object also satisfies megatron-core's
dataset-tokenizer duck type (``vocab_size``, ``eod``, ``pad``, ``unique_identifiers``).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Iterable

from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

SPECIAL_TOKENS = {"bos": "<|bos|>", "eos": "<|eos|>", "pad": "<|pad|>", "mask": "<|mask|>"}


def roles_path(path: str | Path) -> Path:
    """Sidecar that maps roles (bos, eos, pad, mask) to token strings for adopted tokenizers."""
    p = Path(path)
    return p.with_name(p.stem + ".special_tokens.json")


class Tokenizer:
    """Thin wrapper over a ``tokenizers.Tokenizer`` that knows the special ids.

    ``roles`` maps bos / eos / pad / mask to token strings (default :data:`SPECIAL_TOKENS`); adopted
    tokenizers (e.g. GPT-2's, where BOS = EOS = PAD = ``<|endoftext|>``) store theirs in a
    ``<name>.special_tokens.json`` sidecar written by ``tools/train_tokenizer.py --from-tokenizer``.
    """

    def __init__(self, hf: HFTokenizer, source: str = "<memory>", roles: dict | None = None):
        self.hf = hf
        self.source = source
        self.roles = dict(SPECIAL_TOKENS if roles is None else roles)
        missing = [t for t in self.roles.values() if hf.token_to_id(t) is None]
        if missing:
            raise ValueError(f"tokenizer '{source}' lacks the special tokens {missing}; adopt it with "
                             f"tools/train_tokenizer.py --from-tokenizer (adds MASK, records the roles)")
        self.bos = hf.token_to_id(self.roles["bos"])
        self.eos = hf.token_to_id(self.roles["eos"])
        self.pad = hf.token_to_id(self.roles["pad"])
        self.mask = hf.token_to_id(self.roles["mask"])
        if self.mask in (self.bos, self.eos, self.pad):
            raise ValueError(f"tokenizer '{source}': MASK must be a token of its own (it is never a target)")
        self.vocab_size = hf.get_vocab_size()
        self.chat_template: str | None = None   # an adopted model's Jinja chat template (kept in the sidecar)
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
        side = json.loads(roles_path(p).read_text()) if roles_path(p).is_file() else {}
        tok = cls(HFTokenizer.from_file(str(p)), source=str(p), roles=side.get("roles"))
        tok.chat_template = side.get("chat_template")
        return tok

    @classmethod
    def adopt(cls, path: str | Path, bos: str, eos: str, pad: str | None = None,
              mask: str = SPECIAL_TOKENS["mask"]) -> "Tokenizer":
        """Use an existing tokenizer.json: add any missing role token (MASK in particular) as a special
        token and record the roles. ``pad`` defaults to ``eos``."""
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"tokenizer file '{p}' does not exist")
        hf = HFTokenizer.from_file(str(p))
        roles = {"bos": bos, "eos": eos, "pad": pad or eos, "mask": mask}
        new = [t for t in dict.fromkeys(roles.values()) if hf.token_to_id(t) is None]
        if new:
            hf.add_special_tokens(new)
        return cls(hf, source=str(p), roles=roles)

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

    @classmethod
    def characters(cls, chars: str, extra_special: tuple = ()) -> "Tokenizer":
        """A character vocabulary: the role tokens, ``extra_special`` (e.g. a separator), then one token per
        character of ``chars`` in that order (ids fixed by the arguments alone). Every character is its own token
        (no merges) and decoding concatenates, so ``decode(encode(s)) == s`` for text over ``chars``; any other
        character is an encoding error."""
        specials = [*SPECIAL_TOKENS.values(), *extra_special]
        vocab = {t: i for i, t in enumerate(dict.fromkeys([*specials, *chars]))}
        hf = HFTokenizer(models.WordLevel(vocab, unk_token=None))
        hf.pre_tokenizer = pre_tokenizers.Split(Regex("(?m)."), behavior="isolated")   # Oniguruma (?m): . matches \n
        hf.decoder = decoders.Fuse()
        hf.add_special_tokens(specials)
        return cls(hf)

    def save(self, path: str | Path) -> None:
        """Write tokenizer.json (and the sidecar when the roles are not the defaults or there is a chat
        template)."""
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.hf.save(str(path))
        side = roles_path(path)
        if self.roles != SPECIAL_TOKENS or self.chat_template:
            extra = {"chat_template": self.chat_template} if self.chat_template else {}
            side.write_text(json.dumps({"roles": self.roles, "ids": self.special_ids, **extra}, indent=2))
        else:
            side.unlink(missing_ok=True)

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


__all__ = ["Tokenizer", "SPECIAL_TOKENS", "roles_path"]
