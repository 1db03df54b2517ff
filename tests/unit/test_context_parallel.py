"""Context-parallel sharding (setdiff_mega/parallel/context.py) in one process: the CP ranks' shards, with
the keys each rank gathers, reproduce full attention row for row, and their losses and statistics add up to
the full micro-batch's, for every objective (AR's odd L - 1 positions padded)."""
import pytest
import torch
import torch.nn.functional as F

from setdiff_mega import methods
from setdiff_mega.diffusion import build_objective
from setdiff_mega.parallel.context import shard_indices, shard_inputs

MASK, EOS, V = 50, 49, 51


def _inputs(name, B=3, L=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    obj = build_objective(name, MASK, block_size=4, D=2, eos_id=EOS)
    tokens = torch.randint(0, 49, (B, L), generator=g)
    padding = torch.zeros(B, L, dtype=torch.bool)
    padding[0, -3:] = True                      # a padded row: per-batch masks and counts
    tokens[padding] = 0
    return obj, obj.build_inputs(tokens, padding=padding, generator=g)


def test_indices_balance_the_chunks_and_cover_every_position():
    idx0, Lp = shard_indices(32, 2, 2, 0)
    idx1, _ = shard_indices(32, 2, 2, 1)
    assert Lp == 16
    assert idx0.tolist() == [0, 1, 2, 3, 12, 13, 14, 15, 16, 17, 18, 19, 28, 29, 30, 31]
    assert sorted(torch.cat([idx0, idx1]).tolist()) == list(range(32))
    idx, Lp = shard_indices(15, 1, 2, 1)       # AR: L - 1 = 15 positions padded to 16
    assert Lp == 16 and idx.tolist() == [4, 5, 6, 7, 8, 9, 10, 11]


@pytest.mark.parametrize("name", ["ar", "mdlm", "bd3lm", "setdlm"])
@pytest.mark.parametrize("cp", [2, 4])
def test_shards_reproduce_attention_loss_and_stats(name, cp):
    obj, full = _inputs(name)
    streams = methods.get(name).streams
    B, T = full.tokens.shape
    H, d = 2, 8
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, H, T + 4, d, generator=g)          # per-position q / k / v from the position id
    qkv = lambda pos: x.gather(2, pos[:, None, :, None].expand(B, H, pos.shape[1], d))  # noqa: E731
    mask = full.attention_mask.bool()[:, None]
    ref = F.scaled_dot_product_attention(qkv(full.position_ids), qkv(full.position_ids), qkv(full.position_ids),
                                         attn_mask=mask)
    logits = torch.randn(B, T - full.logits_start, V, generator=g, requires_grad=True)
    loss, st = obj.loss(logits, full)
    loss.backward()
    parts, grads = [], torch.zeros_like(logits)
    shards = [shard_inputs(full, streams, cp, r) for r in range(cp)]
    keys_pos = torch.cat([s.position_ids for s in shards], 1)           # what the all-gather returns
    for r, sh in enumerate(shards):
        idx, Lp = shard_indices(T, streams, cp, r)
        real = idx < T if streams == 1 else (idx % Lp) < T // streams
        orig = idx if streams == 1 else (idx // Lp) * (T // streams) + idx % Lp
        out = F.scaled_dot_product_attention(qkv(sh.position_ids), qkv(keys_pos), qkv(keys_pos),
                                             attn_mask=sh.attention_mask[:, None])
        torch.testing.assert_close(out[:, :, real], ref[:, :, orig[real]])
        assert torch.isfinite(out).all()                                # padding rows see themselves
        # this rank's logit rows: the full logits at its positions past logits_start
        rows = orig[real & (orig >= full.logits_start)] - full.logits_start
        local = torch.zeros(B, sh.targets.shape[1], V)
        keep = (real & (orig >= full.logits_start))[idx >= (full.logits_start // (T // streams)) * Lp]
        local[:, keep] = logits.detach()[:, rows]
        local.requires_grad_(True)
        lo, s = obj.loss(local, sh)
        lo.backward()
        grads[:, rows] += local.grad[:, keep]
        parts.append((lo.item(), float(s["nll_sum"]), float(s["num_tokens"])))
    assert sum(p[0] for p in parts) == pytest.approx(loss.item(), rel=1e-5)
    assert sum(p[1] for p in parts) == pytest.approx(float(st["nll_sum"]), rel=1e-5)
    assert sum(p[2] for p in parts) == pytest.approx(float(st["num_tokens"]))
    torch.testing.assert_close(grads, logits.grad)
