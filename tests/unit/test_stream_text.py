"""A served job's streamed text (setdiff_mega/serving/job.py): final tokens detokenized incrementally (the
tokenizers library's DecodeStream) give exactly the text of the whole decode, whatever the chunking, with
multi-byte characters split across tokens, and stop strings cut where a full decode would."""
import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from setdiff_mega.decoding.config import GenerationConfig
from setdiff_mega.serving.job import Job

TEXT = "naïve café — 東京 😀 déjà vu, Grüße! " * 4 + "The end. Stop here and more text after it."


class Tok:
    """What a job asks of the project's tokenizer: decode, eos, and the Hugging Face tokenizer ``hf``."""
    eos = 0

    def __init__(self):
        hf = Tokenizer(models.BPE())
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        hf.decoder = decoders.ByteLevel()
        hf.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"],
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        self.hf = hf

    def encode(self, text):
        return self.hf.encode(text).ids

    def decode(self, ids):
        return self.hf.decode(list(ids), skip_special_tokens=False)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("stops", [(), ("Stop",), ("東京 😀 d", "zzz")])
def test_incremental_text_equals_the_whole_decode_in_any_chunking(seed, stops):
    tok = Tok()
    ids = tok.encode(TEXT)
    assert any(len(tok.decode([i]).encode()) != len(tok.decode([i])) or "\ufffd" in tok.decode([i]) for i in ids)
    deltas = []
    job = Job([1], GenerationConfig(max_new_tokens=len(ids)), lambda ev, x: deltas.append(x) if ev == "delta"
              else None, stops=stops, tokenizer=tok)
    rng, at, hit = random.Random(seed), 0, False
    while at < len(ids) and not hit:
        n = rng.choice([1, 1, 2, 3, 7])
        hit = job.extend(ids[at:at + n])
        at += n
        assert "\ufffd" not in "".join(deltas)
    full = tok.decode(ids)
    cut = min((full.find(s) for s in stops if s in full), default=None)
    if cut is not None:
        assert hit and job.reason == "stop" and "".join(deltas) == full[:cut]
    else:
        job.finish(type("Out", (), {"tokens": [ids]})())
        assert "".join(deltas) == full == job.text
