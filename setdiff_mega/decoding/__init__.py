"""The samplers every engine decodes with (SetDLM, AR, BD3LM, MDLM), their KV cache, the context ledger,
logits processors and stopping criteria: plain PyTorch, importing nothing but torch, transformers and this
directory, because every Hugging Face export carries these files (flattened next to
:mod:`setdiff_mega.hfmodel`'s) and the exported model decodes with them.

    base         requests as a batched canvas, GenerationConfig, DecodeState (EOS rule), packing
    cache        batched KV cache storage (per-row lengths, a window of compacted slots + the chunk's scratch)
    context      Ledger: insertion history, crop to cache + chunk <= L, the visibility the cache implies
    runner       ChunkRunner: one [pending ; queries] forward, cached or recomputed
    processors   repetition and length penalties, MASK ban -> token choice
    sampling     token choice (greedy / temperature / nucleus), confidence, top-k + tau commit
    stopping     stopping criteria: strings, regex count, repeat run, low confidence, entropy
    setdlm       the sliding-window set sampler
    baselines    AR (cached), BD3LM (block cache), MDLM (fixed canvas)

Relative imports only, to modules of this directory (tests/unit/test_layering.py checks it).
"""
