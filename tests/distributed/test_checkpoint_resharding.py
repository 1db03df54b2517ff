"""Resharding: a checkpoint written by one (TP, PP) layout loads into another, weights and AdamW moments.

TP = 1 model -> save -> load as TP = 2 (or PP = 2) -> save again from that layout -> load as TP = 1: the
logits are identical and every optimizer tensor is bit-identical; the TP = 2 model's own logits match the
TP = 1 logits (another reduction order: 1e-5). A ZeRO-2 run (DeepSpeed's optimizer shards) and a plain DP
run resume exactly inside one process group as well (see tests/e2e/test_resume.py for kill-and-resume).
"""
import pytest
import torch

from .harness import run_ranks

MC = dict(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2, activation="swiglu",
          zero_init_head=False, make_vocab_size_divisible_by=8)
VOCAB = 61


def _inputs():
    g = torch.Generator().manual_seed(5)
    T = 12
    tokens = torch.randint(0, VOCAB, (2, T), generator=g)
    pos = torch.stack([torch.randperm(T, generator=g) for _ in range(2)])
    mask = (torch.rand(2, T, T, generator=g) < 0.5) | torch.eye(T, dtype=torch.bool)
    return tokens, pos, mask


def _model_and_optimizer(tp=1, pp=1, seed=11):
    from setdiff_mega.config import ModelConfig
    from setdiff_mega.model import build_model
    from setdiff_mega.parallel import initialize

    initialize(tp, pp, seed=seed)
    torch.manual_seed(seed)
    model = build_model(ModelConfig(**MC), VOCAB)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def _optimizer_tensors(model, opt):
    names = {id(p): n for n, p in model.named_parameters()}
    return {(names[id(p)], k): v.clone() for p, st in opt.state.items() for k, v in st.items()}


def _logits(model):
    model.eval()
    with torch.no_grad():
        return model(*_inputs(), logits_start=4)


def _train_and_save(rank, world, path):
    """TP = 1: two AdamW steps on a random loss (non-trivial moments), then save."""
    from setdiff_mega.checkpoint.sharded import save_sharded

    model, opt = _model_and_optimizer()
    for _ in range(2):
        opt.zero_grad()
        (_logits_train(model) ** 2).mean().backward()
        opt.step()
    save_sharded(path, model, opt)
    return {"logits": _logits(model), "opt": _optimizer_tensors(model, opt)}


def _logits_train(model):
    model.train()
    return model(*_inputs(), logits_start=4)


def _reshard(rank, world, src, dst, tp, pp):
    from setdiff_mega.checkpoint.sharded import load_sharded, save_sharded

    model, opt = _model_and_optimizer(tp, pp, seed=99)           # other initial values: all must be loaded
    load_sharded(src, model, opt)
    save_sharded(dst, model, opt)
    return {"logits": _logits(model) if pp == 1 else None}


def _load_single(rank, world, path):
    from setdiff_mega.checkpoint.sharded import load_sharded

    model, opt = _model_and_optimizer(seed=123)
    load_sharded(path, model, opt)
    return {"logits": _logits(model), "opt": _optimizer_tensors(model, opt)}


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_checkpoint_reshards_weights_and_optimizer(tmp_path, tp, pp):
    ref = run_ranks(_train_and_save, world=1, args=(tmp_path / "tp1",))[0]
    par = run_ranks(_reshard, world=2, args=(tmp_path / "tp1", tmp_path / "par", tp, pp))
    back = run_ranks(_load_single, world=1, args=(tmp_path / "par",))[0]
    assert torch.equal(back["logits"], ref["logits"])              # saved by TP=2 / PP=2, loaded as TP=1
    assert set(back["opt"]) == set(ref["opt"]) and len(ref["opt"]) > 0
    for k, v in ref["opt"].items():
        assert torch.equal(back["opt"][k], v), k
    if tp == 2:
        for r in (0, 1):
            torch.testing.assert_close(par[r]["logits"], ref["logits"], rtol=1e-5, atol=1e-6)


def _mismatch(rank, world, path, overrides, vocab):
    from setdiff_mega.checkpoint import CheckpointError
    from setdiff_mega.checkpoint.sharded import load_sharded
    from setdiff_mega.config import ModelConfig
    from setdiff_mega.model import build_model
    from setdiff_mega.parallel import initialize

    initialize(seed=1)
    model = build_model(ModelConfig(**{**MC, **overrides}), vocab)
    try:
        load_sharded(path, model)
    except CheckpointError as e:
        return str(e)
    return None


@pytest.mark.parametrize("overrides,vocab,message", [
    ({"hidden_size": 64}, VOCAB, r"tensor 'decoder.final_layernorm.bias' has global shape \(32,\), this model "
                                 r"expects \(64,\) \(a different model size"),
    ({}, 100, r"tensor 'embedding.word_embeddings.weight' has global shape \(64, 32\), this model expects "
              r"\(104, 32\) \(the vocabulary differs"),
    ({"num_layers": 5}, VOCAB, r"has global shape \(4, .*\), this model expects \(5, .*\) \(a different model size"),
    ({"normalization": "RMSNorm"}, VOCAB, r"has weights this model does not have \(.*layer_norm_bias"),
    ({"head_bias": False}, VOCAB, r"has weights this model does not have \(output_layer.bias\)"),
])
def test_mismatched_checkpoint_names_the_tensor_and_shapes(tmp_path, overrides, vocab, message):
    import re

    run_ranks(_train_and_save, world=1, args=(tmp_path / "ck",))
    msg = run_ranks(_mismatch, world=1, args=(tmp_path / "ck", overrides, vocab))[0]
    assert msg is not None and re.search(message, msg), msg
    assert str(tmp_path / "ck") in msg
