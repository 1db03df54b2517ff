"""setdiff-mega: distributed pretraining of set diffusion language models (SetDLM) on megatron-core.

Subpackages: ``diffusion`` (schedules, orders, masks, objectives; pure torch), ``model`` (the
transformer on megatron-core), ``data`` (tokenizer, embedded corpus, indexed datasets), ``training``
(the loop), ``parallel`` (process groups), ``decoding`` / ``hfmodel`` (the samplers and the Hugging Face
model every export carries); ``docs/architecture.md`` is the map. Importing this package imports nothing
heavy; it installs the filters below for library warnings and log lines that users cannot act on (they
would otherwise precede every tool's output, before any entry point runs).
"""
import logging as _logging
import warnings as _warnings

# Expected on CPU machines: megatron-core announces its pure-torch fallbacks at import time.
_warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).*(not installed|Falling back).*")
_warnings.filterwarnings("ignore", message=r"Apex is not installed.*")
_warnings.filterwarnings("ignore", message=r"full scope is deprecated.*")
# megatron-core 0.16.1's torch_dist strategy calls torch.distributed.checkpoint APIs torch 2.13 deprecates.
_warnings.filterwarnings("ignore", message=r"`(load_state_dict|save_state_dict)` is deprecated.*")
_warnings.filterwarnings("ignore", message=r"Please use DTensor instead.*")
# torchao's optional CUDA kernels that a CPU wheel cannot load ("Failed to load .../_C_cutlass_90a.abi3.so"), when
# transformers imports it, and torch's deprecation notice for torchao's pytree registrations (errors still pass).
QUIET_LOGGERS = ("torchao", "torch.utils._pytree")
for _name in QUIET_LOGGERS:
    _logging.getLogger(_name).setLevel(_logging.ERROR)


class _DropUnknownMLP(_logging.Filter):
    """megatron-core's TransformerLayer logs "Unknown MLP type" for any MLP class but its own; ours
    (``model.spec.BiasedMLP``, megatron-core's MLP with its own bias setting) takes the default arguments on
    purpose."""

    def filter(self, record: _logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Unknown MLP type")


_logging.getLogger("megatron.core.transformer.transformer_layer").addFilter(_DropUnknownMLP())

__version__ = "0.1.0"
