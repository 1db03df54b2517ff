"""Training under TP = 2 and PP = 2 (two gloo ranks) reproduces single-process training step by step, and
the checkpoint (read back into the single-process layout) holds the same weights. All runs start
from one saved initial checkpoint (``train.init_from``, scattered into each layout), since stages draw
their initial weights from different RNG sequences."""
import pytest
import torch

from .harness import run_ranks

STEPS = 4
# Adam's update m / sqrt(v) is about +-lr for a near-zero gradient, so rounding-level gradient differences
# (another reduction order) can move a rarely-seen embedding row by a small fraction of lr = 3e-3. A real
# bug moves many weights by ~lr or more; 1e-4 (3% of one step) separates the two.
ATOL_WEIGHTS = 1e-4


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    from setdiff_mega.data.prepare import prepare

    out = tmp_path_factory.mktemp("ptdata")
    prepare(out, None, num_math=150, num_stories=150, vocab_size=400, heldout=10, log=lambda *a: None)
    return out


def _config(data_dir, save_dir, tp, pp, objective, init=None, mbs=4, zero=0, sp=False, extra=()):
    from setdiff_mega.config import load_config

    return load_config(None, [
        "model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=4", "model.activation=swiglu",
        "model.zero_init_head=false", "data.seq_length=32", f"data.path={data_dir}/corpus",
        f"train.micro_batch_size={mbs}", "train.grad_accum_steps=2", f"train.train_steps={STEPS}", "train.eval_iters=1",
        "train.eval_interval=0", "train.log_interval=1", "train.warmup_steps=1", "train.lr=3e-3",
        "train.clip_grad=0.5", f"train.save_dir={save_dir}", "logging.wandb=disabled", "logging.progress=false",
        "logging.jsonl=false", f"objective.name={objective}",
        f"parallel.tensor_model_parallel_size={tp}", f"parallel.pipeline_model_parallel_size={pp}"]
        + ([f"train.init_from={init}"] if init else []) + [f"train.zero_stage={zero}",
                                                            f"parallel.sequence_parallel={sp}", *extra])


def _make_init(rank, world, data_dir, path, extra=()):
    """Random initial weights saved once, so every layout starts from the same model."""
    from setdiff_mega.checkpoint import save_model_checkpoint
    from setdiff_mega.data import Tokenizer
    from setdiff_mega.model import build_model
    from setdiff_mega.parallel import initialize

    cfg = _config(data_dir, path, 1, 1, "setdlm", extra=extra)
    initialize(seed=7)
    torch.manual_seed(7)            # the forked child would otherwise inherit the parent's RNG state
    tok = Tokenizer.from_file(f"{data_dir}/tokenizer.json")
    save_model_checkpoint(path, 0, build_model(cfg.model, tok.vocab_size), cfg, tok)
    return True


def _weights(rank, world, path, kind="raw"):
    """The single-process state dict of a checkpoint written by any layout (resharded on load)."""
    from setdiff_mega.checkpoint import full_state_dict

    return full_state_dict(path, weights=kind)


def _train(rank, world, data_dir, save_dir, tp, pp, objective, init, mbs=4, zero=0, sp=False, extra=()):
    from setdiff_mega.model import setcausal
    from setdiff_mega.training import train

    calls, segment_calls = [], []
    real, real_segments = setcausal.setcausal_attention, setcausal.segment_attention
    setcausal.setcausal_attention = lambda *a: calls.append(1) or real(*a)      # count decomposed calls
    setcausal.segment_attention = lambda *a: segment_calls.append(1) or real_segments(*a)   # CP views
    cfg = _config(data_dir, save_dir, tp, pp, objective, init, mbs, zero, sp, extra)
    try:
        res = train(cfg, log=lambda *a: None)
    finally:
        setcausal.setcausal_attention, setcausal.segment_attention = real, real_segments
    rows = [r for r in res.history if "train/loss" in r]
    out = {"loss": [r["train/loss"] for r in rows], "gnorm": [r["train/grad_norm"] for r in rows],
           "val": res.final_val_loss, "params": res.num_parameters, "decomposed_calls": len(calls),
           "segment_calls": len(segment_calls)}
    return out


def _run(tiny_data, save_dir, world, *args):
    out = run_ranks(_train, world=world, args=(tiny_data, save_dir, *args))
    out[0]["weights"] = run_ranks(_weights, world=1, args=(save_dir,))[0]
    return out


_CACHE: dict = {}            # the same initial weights / single-process run serve every test that asks for them


def _init(tiny_data, extra=()):
    """The saved initial checkpoint of ``extra`` (made once per module: every test starts from the same one)."""
    key = ("init", str(tiny_data), tuple(extra))
    if key not in _CACHE:
        path = tiny_data / "inits" / str(len(_CACHE))
        run_ranks(_make_init, world=1, args=(tiny_data, path, tuple(extra)))
        _CACHE[key] = path
    return _CACHE[key]


def _ref(tiny_data, *args):
    """The single-process run of ``args`` (``_train``'s arguments after the save directory), run once."""
    key = ("ref", str(tiny_data), *map(str, args))
    if key not in _CACHE:
        path = tiny_data / "refs" / str(len(_CACHE))
        _CACHE[key] = {**_run(tiny_data, path, 1, *args)[0], "dir": path}
    return _CACHE[key]


def _assert_matches(ref, out, val=True):
    """Every rank logged the single-process losses / gradient norms (global norm across shards), the same
    validation loss and parameter count, and the checkpoint holds the single-process weights."""
    for o in (out.values() if isinstance(out, dict) else out):
        assert o["loss"] == pytest.approx(ref["loss"], rel=1e-4)
        assert o["gnorm"] == pytest.approx(ref["gnorm"], rel=1e-4)
        if val:
            assert o["val"] == pytest.approx(ref["val"], rel=1e-4)
        assert o["params"] == ref["params"]
    assert set(ref["weights"]) == set(out[0]["weights"])
    for k, v in ref["weights"].items():
        torch.testing.assert_close(out[0]["weights"][k], v, rtol=1e-3, atol=ATOL_WEIGHTS, msg=k)


@pytest.mark.parametrize("tp,pp,objective", [(2, 1, "setdlm"), (1, 2, "setdlm"), (2, 1, "bd3lm"), (1, 1, "setdlm")])
def test_parallel_training_matches_single_process(tiny_data, tmp_path, tp, pp, objective):
    """(1, 1) on two ranks is DP = 2 with half the micro-batch: the same global batch and noise as DP = 1."""
    init = _init(tiny_data)
    ref = _ref(tiny_data, 1, 1, objective, init)
    mbs = 2 if tp * pp == 1 else 4
    out = _run(tiny_data, tmp_path / "par", 2, tp, pp, objective, init, mbs)
    _assert_matches(ref, out)


@pytest.mark.parametrize("tp,pp,objective", [(2, 1, "setdlm")])
def test_shifted_training_matches_single_process(tiny_data, tmp_path, tp, pp, objective):
    """The AR head alignment (model.shift_logits: logits on both streams, gathered per target) trains the same
    under TP = 2 (vocabulary-sharded head) as in one process (PP = 2 with BD3LM was checked the same way)."""
    init, shift = _init(tiny_data), ("model.shift_logits=true",)
    ref = _ref(tiny_data, 1, 1, objective, init, 4, 0, False, shift)
    out = _run(tiny_data, tmp_path / "par", 2, tp, pp, objective, init, 4, 0, False, shift)
    _assert_matches(ref, out)


@pytest.mark.parametrize("model,layout", [(("train.ema_decay=0.9",), ()),
                                          (("model.num_layers=4",),
                                           ("parallel.virtual_pipeline_model_parallel_size=2",))])
def test_tied_embeddings_across_pipeline_stages_match_single_process(tiny_data, tmp_path, model, layout):
    """Qwen3-style tied embeddings under PP = 2, also interleaved (megatron-core's protocol: a synchronised copy
    of the embedding on the last stage, gradients summed over the embedding group, the copy a checkpoint
    replica): the same losses, gradient norms, parameter count and checkpoint (with its EMA) as one process."""
    tied = ("model.tie_embeddings=true", *model)
    init = _init(tiny_data, tied)
    ref = _ref(tiny_data, 1, 1, "setdlm", init, 4, 0, False, tied)
    out = _run(tiny_data, tmp_path / "par", 2, 1, 2, "setdlm", init, 4, 0, False, (*tied, *layout))
    _assert_matches(ref, out)
    assert "output_layer.weight" not in ref["weights"]
    if any("ema" in m for m in model):              # the EMA of the embedding and of its copy: one tensor
        ema = [run_ranks(_weights, world=1, args=(d, "ema"))[0] for d in (ref["dir"], tmp_path / "par")]
        for k, v in ema[0].items():
            torch.testing.assert_close(ema[1][k], v, rtol=1e-3, atol=ATOL_WEIGHTS, msg=k)


@pytest.fixture(scope="module")
def sft_data(tiny_data):
    """The embedded math problems as prompt / response conversations (data.format=sft)."""
    import json

    from setdiff_mega.data.sft import preprocess_sft

    rows = [json.loads(x) for x in (tiny_data / "tasks" / "math.jsonl").read_text().splitlines()]
    src = tiny_data / "sft.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"Question: {r['question']}\n", "response": r["solution"]}) + "\n"
                           for r in rows))
    preprocess_sft([str(src)], str(tiny_data / "sft" / "math"), str(tiny_data / "tokenizer.json"), workers=1,
                   progress=False, log=lambda *a: None)
    return ("data.format=sft", f"data.path={tiny_data / 'sft' / 'math'}", f"data.tokenizer={tiny_data}/tokenizer.json",
            "data.seq_length=128", "data.split=90,10,0")


@pytest.mark.parametrize("tp,pp,zero,packing", [(2, 1, 0, False), (1, 2, 0, False), (1, 1, 2, False),
                                                (2, 1, 0, True), (1, 2, 0, True), (1, 1, 2, True), (1, 1, 0, True)])
def test_sft_training_matches_single_process(tiny_data, sft_data, tmp_path, tp, pp, zero, packing):
    """Padded conversations (the prompt as context, right padding) or packed ones (several per sample, each
    with its own attention, order and positions) under TP = 2, PP = 2, DP = 2 and DP = 2 with ZeRO-2: the
    single-process losses, gradient norms and weights. Packed under DP the ranks' micro-batches hold different
    numbers of conversations: each divides by the global batch's count, so the mean over conversations is one
    process's. Padded: the stream wraps around inside micro-batches, whose rows keep their own noise epochs."""
    data = (*sft_data, "data.packing=true", "data.seq_length=320") if packing else sft_data  # 2-3 per sample
    init = _init(tiny_data, data)
    ref = _ref(tiny_data, 1, 1, "setdlm", init, 4, 0, False, data)
    out = _run(tiny_data, tmp_path / "par", 2, tp, pp, "setdlm", init, 2 if tp * pp == 1 else 4, zero, False, data)
    _assert_matches(ref, out)


def test_pipeline_training_with_the_setcausal_backend_matches_dense_single_process(tiny_data, tmp_path):
    """PP = 2 with the mask-free set-causal attention (the pattern travels through megatron-core's 1F1B
    schedule with each micro-batch) trains like one process with the dense-mask reference."""
    init = _init(tiny_data)
    ref = _ref(tiny_data, 1, 1, "setdlm", init)
    out = _run(tiny_data, tmp_path / "par", 2, 1, 2, "setdlm", init, 4, 0, False,
               ("model.attention_backend=setcausal",))
    _assert_matches(ref, out)
    assert ref["decomposed_calls"] == 0 and all(out[r]["decomposed_calls"] > 0 for r in (0, 1))


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_zero_data_parallel_matches_single_process(tiny_data, tmp_path, zero):
    """DP = 2 with DeepSpeed ZeRO (optimizer states / gradients / parameters sharded) after the steps has the
    parameters of DP = 1 with the project's AdamW and the same global batch."""
    init = _init(tiny_data)
    ref = _ref(tiny_data, 1, 1, "setdlm", init)
    out = _run(tiny_data, tmp_path / "zero", 2, 1, 1, "setdlm", init, 2, zero)
    _assert_matches(ref, out, val=False)


@pytest.mark.parametrize("objective", ["setdlm", "mdlm"])
def test_sequence_parallel_training_matches_single_process(tiny_data, tmp_path, objective):
    """TP = 2 with sequence parallelism (norms on sequence shards, their gradients summed over TP)."""
    init = _init(tiny_data)
    ref = _ref(tiny_data, 1, 1, objective, init)
    out = _run(tiny_data, tmp_path / "sp", 2, 2, 1, objective, init, 4, 0, True)
    _assert_matches(ref, out)


def test_tensor_and_data_parallel_together(tiny_data, tmp_path):
    """TP = 2 x DP = 2 on four ranks: the logged loss is the data-parallel mean (not scaled by TP)."""
    init = _init(tiny_data)
    ref = _ref(tiny_data, 1, 1, "setdlm", init)
    out = _run(tiny_data, tmp_path / "tpdp", 4, 2, 1, "setdlm", init, 2)
    _assert_matches(ref, out)


def _train_resume(rank, world, data_dir, save_dir, zero, resume, steps=STEPS, extra=()):
    from setdiff_mega.training import train

    cfg = _config(data_dir, save_dir, 1, 1, "setdlm", None, 2, zero, extra=[
        "train.save_interval=2", "train.keep_last=0", f"train.resume={resume}", f"train.train_steps={steps}",
        "logging.jsonl=true", *extra])
    try:
        res = train(cfg, log=lambda *a: None)
    except Exception as e:                  # noqa: BLE001  (the message is what the test checks)
        return {"error": f"{type(e).__name__}: {e}"}
    return {(r["step"]): (r["train/loss"], r["train/grad_norm"]) for r in res.history if "train/loss" in r}


@pytest.mark.parametrize("zero", [0, 2])
def test_resume_from_a_middle_checkpoint_is_exact(tiny_data, tmp_path, zero):
    """DP = 2 (torch DDP + AdamW shards in the dist checkpoint, or DeepSpeed ZeRO-2 shards): resuming from
    the step-2 checkpoint into a fresh directory gives the losses and gradient norms of steps 3-4 bit for bit."""
    full = run_ranks(_train_resume, world=2, args=(tiny_data, tmp_path / "full", zero, "none"))
    mid = tmp_path / "full" / "checkpoints" / "step_0000002"
    assert (mid / "state.json").is_file()
    resumed = run_ranks(_train_resume, world=2, args=(tiny_data, tmp_path / "resumed", zero, str(mid)))
    for r in (0, 1):
        assert sorted(resumed[r]) == [3, 4]
        assert {s: full[r][s] for s in (3, 4)} == resumed[r]
    # the other optimizer kind refuses the state and names the switch
    other = run_ranks(_train_resume, world=2, args=(tiny_data, tmp_path / "other", 2 - zero, str(mid)))[0]
    assert "error" in other and "train.resume_optimizer=false" in other["error"]


def test_resume_with_tied_embeddings_across_stages_is_exact(tiny_data, tmp_path):
    """PP = 2 with tied embeddings: the last stage's copy and its AdamW moments come back from the embedding's
    tensors (the copy is a checkpoint replica): steps 3-4 after a resume are bit for bit."""
    extra = ("model.tie_embeddings=true", "parallel.pipeline_model_parallel_size=2")
    full = run_ranks(_train_resume, world=2, args=(tiny_data, tmp_path / "full", 0, "none", STEPS, extra))
    mid = tmp_path / "full" / "checkpoints" / "step_0000002"
    resumed = run_ranks(_train_resume, world=2, args=(tiny_data, tmp_path / "resumed", 0, str(mid), STEPS, extra))
    for r in (0, 1):
        assert sorted(resumed[r]) == [3, 4] and {s: full[r][s] for s in (3, 4)} == resumed[r]


def test_interleaved_pipeline_with_data_parallel_matches_single_process(tiny_data, tmp_path):
    """PP = 2 with V = 2 virtual stages (4 layers: stage 0 holds layers 0 and 2, stage 1 layers 1 and 3) x
    DP = 2, run by megatron-core's interleaved 1F1B schedule with its DDP (small buckets, each chunk's
    reduction started by the schedule and overlapped), reproduces single-process training; its checkpoint
    (per-chunk shards with global layer indices) reads back as the single-process model."""
    layers = ["model.num_layers=4"]
    init = _init(tiny_data, layers)
    ref = _ref(tiny_data, 1, 1, "setdlm", init, 4, 0, False, layers)
    out = _run(tiny_data, tmp_path / "vp", 4, 1, 2, "setdlm", init, 2, 0, False,
               layers + ["parallel.virtual_pipeline_model_parallel_size=2", "parallel.ddp_bucket_size=2000"])
    _assert_matches(ref, out)


def _ema_weights(rank, world, path):
    from setdiff_mega.checkpoint import full_state_dict

    return full_state_dict(path, weights="ema")


EMA = ("train.ema_decay=0.7",)


@pytest.mark.parametrize("tp,pp,zero", [(2, 1, 0), (1, 2, 0), (1, 1, 2), (1, 1, 3)])
def test_ema_matches_single_process(tiny_data, tmp_path, tp, pp, zero):
    """The EMA of the weights (updated after every step on each rank's own shards / ZeRO-3 partitions, saved
    sharded like the weights) read back as one process equals the single-process EMA."""
    init = _init(tiny_data)
    if ("ema", str(tiny_data)) not in _CACHE:          # one single-process run for every layout
        run_ranks(_train, world=1, args=(tiny_data, tiny_data / "ema_ref", 1, 1, "setdlm", init, 4, 0, False, EMA))
        _CACHE["ema", str(tiny_data)] = [run_ranks(f, world=1, args=(tiny_data / "ema_ref",))[0]
                                         for f in (_ema_weights, _weights)]
    ref, raw = _CACHE["ema", str(tiny_data)]
    mbs = 2 if tp * pp == 1 else 4
    run_ranks(_train, world=2, args=(tiny_data, tmp_path / "par", tp, pp, "setdlm", init, mbs, zero, False, EMA))
    out = run_ranks(_ema_weights, world=1, args=(tmp_path / "par",))[0]
    assert set(ref) == set(out)
    assert any(not torch.equal(ref[k], raw[k]) for k in ref)            # the EMA is not the raw weights
    for k, v in ref.items():
        torch.testing.assert_close(out[k], v, rtol=1e-3, atol=ATOL_WEIGHTS, msg=k)


@pytest.mark.parametrize("zero", [0, 3])
def test_resume_with_ema_is_exact(tiny_data, tmp_path, zero):
    """DP = 2 with the EMA on (torch DDP, or ZeRO-3 with the EMA of each rank's partitions): resuming from the
    step-2 checkpoint gives the losses of steps 3-4 and the final EMA bit for bit."""
    full = run_ranks(_train_resume, world=2, args=(tiny_data, tmp_path / "full", zero, "none", STEPS, EMA))
    mid = tmp_path / "full" / "checkpoints" / "step_0000002"
    resumed = run_ranks(_train_resume, world=2, args=(tiny_data, tmp_path / "resumed", zero, str(mid), STEPS, EMA))
    assert {s: full[0][s] for s in (3, 4)} == resumed[0]
    a = run_ranks(_ema_weights, world=1, args=(tmp_path / "full",))[0]
    b = run_ranks(_ema_weights, world=1, args=(tmp_path / "resumed",))[0]
    assert all(torch.equal(a[k], b[k]) for k in a)
