"""Native checkpoints as models: load for inference / fine-tuning, save weights-only checkpoints.

``load_model(path)`` accepts a run directory, a ``checkpoints/`` directory, one ``step_*`` directory
(all: the native format of :mod:`.io`) or an exported Hugging Face directory (:mod:`.hf`), and returns
``(model, objective, tokenizer, config)`` for the current process's TP / PP layout (one process:
the whole model). ``save_model_checkpoint`` writes a weights-only native checkpoint (same layout and
publication protocol as training checkpoints, without optimizer or data position): the Hugging Face
importer and tests use it.
"""
from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from setdiff_mega.build import model_for, objective_for, vocab_for
from setdiff_mega.config import ConfigError, dump_yaml, load_config
from setdiff_mega.data.tokenizer import Tokenizer
from setdiff_mega.parallel import initialize

from . import hf
from .io import CheckpointError, latest_checkpoint, prepare_staging, publish, resolve_checkpoint, staging_dir
from .sharded import has_ema, load_sharded, save_releasing, save_sharded


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def checkpoint_config(ck: Path):
    try:
        return load_config(ck / "config.yaml", check=False)
    except (ConfigError, FileNotFoundError) as e:
        raise CheckpointError(f"'{ck / 'config.yaml'}': {e}") from None


def checkpoint_tokenizer(ck: Path):
    try:
        return Tokenizer.from_file(ck / "tokenizer.json")
    except (FileNotFoundError, ValueError) as e:
        raise CheckpointError(f"checkpoint tokenizer '{ck / 'tokenizer.json'}': {e}") from None


SHAPES = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size", "kv_channels",
          "normalization", "norm_bias", "qk_layernorm", "activation", "add_bias_linear", "add_qkv_bias", "mlp_bias",
          "head_bias", "tie_embeddings", "make_vocab_size_divisible_by")
# the function the weights compute, beyond their shapes
ARCHITECTURE = SHAPES + ("family", "vocab_size", "norm_eps", "rotary_base", "rotary_percent", "rope_scaling",
                         "rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor",
                         "rope_original_max_positions", "max_position_embeddings")


def adopt_architecture(cfg, init_from: str | Path | None = None) -> dict:
    """With ``train.init_from`` and ``train.init_architecture`` (the default, like Megatron-LM's
    ``--use-checkpoint-args``), the run's model.* architecture fields become the checkpoint's (an imported
    Qwen3 or Llama needs no model.* overrides); the kernels, precision and recomputation stay the run's.
    Returns the fields that changed. Without it, a different shape is refused when the weights load
    (:func:`check_model_config`)."""
    init_from = init_from or cfg.train.init_from        # the native checkpoint (hf:DIR resolved: hf_init)
    if not init_from or not cfg.train.init_architecture:
        return {}
    ck, _ = resolve_checkpoint(init_from)
    saved = checkpoint_config(ck).model
    adopted = {f: getattr(saved, f) for f in ARCHITECTURE if getattr(cfg.model, f) != getattr(saved, f)}
    cfg.model = dataclasses.replace(cfg.model, **adopted)
    return adopted


def check_model_config(saved, wanted, source: str) -> None:
    """The architecture fields that decide tensor shapes must agree; name the first difference."""
    for f in SHAPES:
        a, b = getattr(saved, f), getattr(wanted, f)
        if a != b:
            raise CheckpointError(f"{source} was trained with model.{f}={a!r}, this run has model.{f}={b!r}; "
                                  f"set model.{f}={a!r} (or start from another checkpoint)")


def load_weights(model, path: str | Path, model_config=None) -> Path:
    """Collective: load a native checkpoint's weights into ``model`` (any TP / PP layout); returns its dir."""
    ck, _ = resolve_checkpoint(path)
    if model_config is not None:
        check_model_config(checkpoint_config(ck).model, model_config, f"checkpoint '{ck}'")
    load_sharded(ck / "dist", model)
    return ck


def layout_state() -> dict:
    """This process group's parallel layout, as recorded in state.json."""
    return {"world_size": dist.get_world_size() if dist.is_initialized() else 1,
            "tensor_model_parallel_size": ps.get_tensor_model_parallel_world_size(),
            "pipeline_model_parallel_size": ps.get_pipeline_model_parallel_world_size(),
            "context_parallel_size": ps.get_context_parallel_world_size(),
            "data_parallel_size": ps.get_data_parallel_world_size(),
            "zero_partitions": ps.get_data_parallel_world_size(with_context_parallel=True)}


def staged_save(save_dir: str | Path, step: int, write_shards, config, tokenizer, state: dict,
                keep_last: int, async_queue=None) -> Path:
    """Collective save protocol: rank 0 prepares ``step_N.tmp/``, every rank runs ``write_shards(tmp)``,
    then rank 0 adds config and tokenizer and publishes (state.json with the layout last).

    With ``async_queue`` (megatron-core's ``AsyncCallsQueue``), ``write_shards`` returns the shards'
    AsyncRequest: it is scheduled and the publication becomes its last finalize step, run on every rank
    by ``async_queue.maybe_finalize_async_calls`` once every rank's writer is done. Until then only the
    staging directory exists, so a crash never publishes a partial checkpoint. Returns the path the
    checkpoint has (or will have once published)."""
    tmp = prepare_staging(save_dir, step) if _rank() == 0 else staging_dir(save_dir, step)
    _barrier()
    with _write_errors(tmp, step):
        request = write_shards(tmp)
    final = tmp.with_name(tmp.name[: -len(".tmp")])
    layout = layout_state()

    def finish() -> None:
        _barrier()
        if _rank() == 0:
            with _write_errors(tmp, step):
                dump_yaml(config, tmp / "config.yaml")
                tokenizer.save(tmp / "tokenizer.json")
                publish(tmp, {"step": step, **layout, **state}, keep_last=keep_last,
                        checksums=config.train.checkpoint_checksums)
        _barrier()

    if async_queue is None or request is None:
        if request is not None:
            request.execute_sync()
        finish()
    else:
        request.add_finalize_fn(finish)
        async_queue.schedule_async_request(request)
    return final


def _os_error(e: BaseException) -> OSError | None:
    """The OSError behind ``e`` (torch.distributed.checkpoint wraps its writers' errors)."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, OSError):
            return e
        seen.add(id(e))
        nested = [v for v in getattr(e, "failures", {}).values() if isinstance(v, BaseException)] \
            if isinstance(getattr(e, "failures", None), dict) else []
        e = nested[0] if nested else (e.__cause__ or e.__context__)
    return None


class _write_errors:
    """A failed write (full disk, quota, permissions) becomes one CheckpointError naming the path; the
    staging directory is removed (it is never published) and the previous checkpoint stays in place."""

    def __init__(self, tmp: Path, step: int):
        self.tmp, self.step = tmp, step

    def __enter__(self):
        return self

    def __exit__(self, kind, e, tb):
        os_error = _os_error(e) if e is not None and not isinstance(e, CheckpointError) else None
        if os_error is None:
            return False

        shutil.rmtree(self.tmp, ignore_errors=True)
        prev = latest_checkpoint(self.tmp.parent)
        where = os_error.filename or self.tmp
        kept = f"the previous checkpoint '{prev}' is intact" if prev else "no earlier checkpoint exists"
        raise CheckpointError(f"could not write checkpoint step {self.step} ('{where}': "
                              f"{os_error.strerror or os_error}); nothing was published and {kept}"
                              + "; free space (or point train.save_dir elsewhere) and resume with train.resume=auto"
                              ) from None


def save_model_checkpoint(save_dir: str | Path, step: int, model, config, tokenizer,
                          state: dict | None = None, keep_last: int = 0, release: bool = False) -> Path:
    """Collective: a weights-only native checkpoint of ``model`` (published like a training checkpoint);
    ``release``: the model is discarded afterwards, so its weights are released while they are written
    (:func:`.sharded.save_releasing`: the save holds them once)."""
    write = (lambda tmp: save_releasing(tmp / "dist", model)) if release else \
        (lambda tmp: save_sharded(tmp / "dist", model))
    return staged_save(save_dir, step, write, config, tokenizer, {"kind": "weights", **(state or {})}, keep_last)


def load_model(path: str | Path, model_overrides: dict | None = None, weights: str | None = None):
    """(model, objective, tokenizer, config) from a native checkpoint or a Hugging Face export.

    ``model_overrides`` replaces ModelConfig fields that do not change the weights (e.g.
    ``attention_backend``). ``weights``: ``"ema"`` (the EMA of a ``train.ema_decay`` run), ``"raw"``, or None:
    the EMA when the checkpoint has one (``model.weights_kind`` says which were loaded; an export holds the
    weights it was written with).
    """
    if weights not in (None, "ema", "raw"):
        raise ValueError(f"weights={weights!r}: choose ema or raw")
    p = Path(path)
    if hf.is_hf_export(p):
        cfg, tok, tensors = hf.read_export(p)
        if weights is not None and weights != hf.export_weights(p):
            raise CheckpointError(f"'{p}' is an export of the {hf.export_weights(p)} weights; export the "
                                  f"{weights} ones from the native checkpoint (convert_checkpoint.py to-hf --weights)")
        initialize(seed=cfg.train.seed)
        if model_overrides:
            cfg.model = dataclasses.replace(cfg.model, **model_overrides)
        model = model_for(cfg, vocab_for(cfg, tok))
        hf.load_into(model, tensors, p, cfg.model)
        hf.check_checksums(p)                # after the structure: a corruption that still parses (a flipped bit)
        kind = hf.export_weights(p)
    else:
        ck, _ = resolve_checkpoint(p)
        cfg = checkpoint_config(ck)
        tok = checkpoint_tokenizer(ck)
        initialize(seed=cfg.train.seed)      # no-op when the caller already set up parallel state
        if model_overrides:
            cfg.model = dataclasses.replace(cfg.model, **model_overrides)
        model = model_for(cfg, vocab_for(cfg, tok))
        kind = weights or ("ema" if has_ema(ck / "dist") else "raw")
        load_sharded(ck / "dist", model, weights=kind)
    model.weights_kind = kind
    model.eval()
    model.tokenizer_hash = tok.hash          # generation refuses any other tokenizer
    model.training_length = cfg.data.seq_length   # the samplers' default context budget (cache + chunk <= L)
    model.shift_logits = cfg.model.shift_logits   # the samplers read logits with the AR shift (method.md 13)
    model.self_speculative = cfg.objective.options.self_speculative   # speculative decoding accepts it (method.md 16)
    return model, objective_for(cfg, tok), tok, cfg


def full_state_dict(path: str | Path, weights: str = "raw") -> dict:
    """The single-process (TP = PP = 1) state dict of a checkpoint (its raw weights or their EMA), in this
    (single) process."""
    model = load_model(path, weights=weights)[0]
    return {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


__all__ = ["adopt_architecture", "ARCHITECTURE", "load_model", "load_weights", "save_model_checkpoint",
           "full_state_dict", "checkpoint_config", "checkpoint_tokenizer", "check_model_config"]
