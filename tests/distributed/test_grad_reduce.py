"""megatron-core DDP for every non-ZeRO layout (setdiff_mega/parallel/ddp.py): on two gloo ranks the
bucketed, overlapped reduction gives each rank the mean of the ranks' gradients exactly, its buckets'
all-reduces are issued during the last micro-batch's backward (before :meth:`GradReducer.finish`; from
the second step on, once megatron-core has counted each bucket's gradients), and micro-batches under
``no_sync`` issue none."""
import pytest
import torch

from .harness import run_ranks


def _reduce(rank, world, overlap):
    import torch.distributed as dist

    from setdiff_mega.config import ModelConfig
    from setdiff_mega.diffusion import build_objective
    from setdiff_mega.model import build_model
    from setdiff_mega.parallel import initialize
    from setdiff_mega.parallel.ddp import GradReducer

    initialize(seed=3)
    mc = ModelConfig(num_layers=3, hidden_size=32, num_attention_heads=4, zero_init_head=False,
                     make_vocab_size_divisible_by=8)
    model = build_model(mc, 61)
    torch.manual_seed(rank)                        # different weights per rank: the wrap broadcasts rank 0's
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
    reducer = GradReducer(model, overlap=overlap, bucket_size=3000)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    obj = build_objective("setdlm", 60, D=4)
    micro = [obj.build_inputs(torch.randint(0, 58, (2, 12), generator=torch.Generator().manual_seed(10 * rank + m)),
                              generator=torch.Generator().manual_seed(m)) for m in range(2)]
    for step in range(2):          # megatron-core learns each bucket's readiness counts in the first step
        reducer.zero()
        issued = []
        for i, inp in enumerate(micro):
            with reducer.no_sync() if i == 0 else torch.enable_grad():
                loss, _ = obj.loss(reducer(**inp.model_kwargs()), inp)
                (loss / 2).backward()
            issued.append(sum(bg.grad_reduce_handle is not None for c in reducer.chunks for bg in c.bucket_groups))
        reducer.finish()
    local = build_model(mc, 61)                    # the same micro-batches without DDP, averaged by hand
    local.load_state_dict(model.state_dict())
    for inp in micro:
        loss, _ = obj.loss(local(**inp.model_kwargs()), inp)
        (loss / 2).backward()
    err = 0.0
    for (n, p), q in zip(model.named_parameters(), local.parameters()):
        want = q.grad.clone()
        dist.all_reduce(want)
        err = max(err, (p.grad - want / world).abs().max().item())
    return {"err": err, "buckets": reducer.num_buckets, "issued": issued, "weights": weights}


@pytest.mark.parametrize("overlap", [True, False])
def test_grad_reducer_averages_exactly_and_overlaps_the_last_backward(overlap):
    out = run_ranks(_reduce, world=2, args=(overlap,))
    for r in (0, 1):
        assert out[r]["err"] == 0.0
        assert out[r]["buckets"] > 1 if overlap else out[r]["buckets"] == 1    # without overlap: one bucket
        # no_sync issues nothing; with overlap every bucket was issued during the last backward
        assert out[r]["issued"] == [0, out[r]["buckets"] if overlap else 0]
    for k, v in out[0]["weights"].items():              # rank 1 holds rank 0's weights after the wrap
        torch.testing.assert_close(out[1]["weights"][k], v, rtol=0, atol=0)


@pytest.mark.slow            # the benchmark's runner; the reducer's exactness above stays in the default suite
def test_grad_reduce_benchmark_runs_both_variants_with_equal_losses(tmp_path):
    """tools/bench_grad_reduce.py's runner at toy size: every layout and variant, equal losses, a ratio."""
    from benchmarks.grad_reduce import run
    from setdiff_mega.data.prepare import prepare

    prepare(tmp_path, None, num_math=60, num_stories=60, vocab_size=300, heldout=4, log=lambda *a: None)
    rows = run(tmp_path, tmp_path, ["model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=4",
                                    "data.seq_length=32", "train.micro_batch_size=2", "train.grad_accum_steps=2"],
               steps=3, warmup=1, bucket_size=2000, log=lambda *a: None)
    assert [(r["pp"], r["overlap"]) for r in rows] == [(1, True), (1, False), (2, True), (2, False)]
    assert all(r["median_step_s"] > 0 and len(r["losses"]) == 3 for r in rows)
    assert rows[0]["ratio_off_over_on"] > 0 and rows[2]["ratio_off_over_on"] > 0
