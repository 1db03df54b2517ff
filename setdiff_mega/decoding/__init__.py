"""The samplers every engine decodes with (SetDLM, AR, BD3LM, MDLM), their KV cache, the context ledger,
logits processors and stopping criteria: plain PyTorch, importing nothing but torch, transformers and this
directory, because every Hugging Face export carries these files (flattened next to
:mod:`setdiff_mega.hfmodel`'s) and the exported model decodes with them.

    config       GenerationConfig and BOUNDS, the one table every option is checked against
    base         requests as a batched canvas, DecodeState (EOS rule, progress check), packing
    calls        decoding as step functions: Call, next_calls / advance, drive, fused_forward
    session      the Sampler and Session bases of every sampler: the typed decode state, admit / retire / output
    cache        batched KV cache storage (per-row lengths, a window of compacted slots + the chunk's scratch)
    context      Ledger: insertion history, crop to cache + chunk <= L, the visibility the cache implies
    runner       ChunkRunner: one [pending ; queries] forward, cached or recomputed
    processors   repetition and length penalties, MASK ban -> token choice
    sampling     token choice (greedy / temperature / nucleus), confidence, top-k + tau commit
    stopping     stopping criteria: strings, regex count, repeat run, low confidence, entropy
    setdlm       the sliding-window set sampler (a session: rows join and leave between steps)
    baselines    AR (cached), BD3LM (block cache), MDLM (fixed canvas), each a session too

Relative imports only, to modules of this directory (tests/unit/test_layering.py checks it).
"""
