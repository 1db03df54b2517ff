"""Supervised SetDLM loss (issue 31): on padded conversations from the SFT data path, the objective's loss
equals the reference's definition with its context mask, computed here from ``docs/method.md`` 3 in the
reference's own layout (x0[perm], targets MASKed in the noisy stream, the static set-causal mask in rank space
with the permuted padding mask, the noisy half's logits, MASK logit -1e12, a per-sequence mean over the
permuted target mask, then the batch mean), to 1e-6 in fp32."""
import json

import torch

from ..unit.test_sft_data import QWEN3_STYLE


def _reference_loss(model, x0, attn, ctx, perm, mask_id):
    """docs/method.md 3, step by step."""
    B, L = x0.shape
    target = attn & ~ctx
    x0p = x0.gather(1, perm)
    tgt_p = target.gather(1, perm)
    xtp = torch.where(tgt_p, torch.full_like(x0p, mask_id), x0p)
    inp = torch.cat([x0p, xtp], 1)
    pos2 = torch.cat([perm, perm], 1)
    i = torch.arange(L)
    cc, nc, nn = i[None, :] <= i[:, None], i[None, :] < i[:, None], i[None, :] == i[:, None]
    static = torch.cat([torch.cat([cc, torch.zeros_like(cc)], 1), torch.cat([nc, nn], 1)], 0)
    keys = attn.gather(1, perm).repeat(1, 2)
    mask = static[None] & keys[:, None, :] | torch.eye(2 * L, dtype=torch.bool)[None]   # pad rows: themselves
    logits = model(inp, pos2, mask, 0)[:, L:].float()
    logits[..., mask_id] = -1e12
    nll = -torch.log_softmax(logits, -1).gather(-1, x0p[..., None])[..., 0]
    t = tgt_p.float()
    per_seq = torch.where(t.sum(1) > 0, (nll * t).sum(1) / t.sum(1).clamp(min=1), torch.zeros(B))
    return per_seq.mean()


def test_padded_conversations_give_the_references_setdlm_loss(mcore, tmp_path):
    from setdiff_mega.config import ModelConfig
    from setdiff_mega.data.batch import batches
    from setdiff_mega.data.prepare import prepare
    from setdiff_mega.data.sft import preprocess_sft
    from setdiff_mega.data.supervised import build_sft_splits
    from setdiff_mega.data.tokenizer import Tokenizer
    from setdiff_mega.diffusion import build_objective, inputs_for
    from setdiff_mega.model import build_model

    prepare(tmp_path / "tok", None, num_math=30, num_stories=30, vocab_size=300, heldout=2, log=lambda *a: None)
    tok = Tokenizer.from_file(tmp_path / "tok" / "tokenizer.json")
    tok.chat_template = QWEN3_STYLE
    tok.save(tmp_path / "chat" / "tokenizer.json")
    records = [{"prompt": f"Question {i}: " + "two plus two " * (i % 4), "response": "four " * (1 + i % 5)}
               for i in range(12)]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    preprocess_sft([str(tmp_path / "c.jsonl")], str(tmp_path / "sft" / "c"), str(tmp_path / "chat" / "tokenizer.json"),
                   workers=1, progress=False, log=lambda *a: None)
    train, _, _ = build_sft_splits(str(tmp_path / "sft" / "c"), tok, 256, "1,0,0", 3, needed=("train",))
    batch = next(batches(train, 4))
    assert batch.context.any() and batch.padding.any()
    torch.manual_seed(0)
    model = build_model(ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, zero_init_head=False,
                                    init_method_std=0.2), tok.vocab_size).eval()
    obj = build_objective("setdlm", tok.mask, D=2)
    inp = inputs_for(obj, batch, seed=5)
    with torch.no_grad():
        ours = obj.loss(model(**inp.model_kwargs()), inp)[0]
        ref = _reference_loss(model, batch.tokens, ~batch.padding, batch.context, inp.extras["perm"], tok.mask)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
    perm = inp.extras["perm"]
    n_ctx = batch.context.sum(1)
    for b in range(4):                       # the prompt takes the first ranks, in position order; padding the last
        assert perm[b, : n_ctx[b]].tolist() == torch.nonzero(batch.context[b])[:, 0].tolist()
        n_pad = int(batch.padding[b].sum())
        assert set(perm[b, 256 - n_pad:].tolist()) == set(torch.nonzero(batch.padding[b])[:, 0].tolist())
