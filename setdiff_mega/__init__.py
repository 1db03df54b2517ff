"""setdiff-mega: distributed pretraining of set diffusion language models (SetDLM) on megatron-core.

Subpackages: ``diffusion`` (schedules, orders, masks, objectives; pure torch), ``model`` (the
transformer on megatron-core), ``data`` (tokenizer, embedded corpus, indexed datasets), ``training``
(the loop), ``parallel`` (process groups). Importing this package does not import megatron-core.
"""
import warnings as _warnings

# Expected on CPU machines: megatron-core announces its pure-torch fallbacks at import time.
_warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).*(not installed|Falling back).*")
_warnings.filterwarnings("ignore", message=r"Apex is not installed.*")
_warnings.filterwarnings("ignore", message=r"full scope is deprecated.*")
# megatron-core 0.16.1's torch_dist strategy calls torch.distributed.checkpoint APIs torch 2.13 deprecates.
_warnings.filterwarnings("ignore", message=r"`(load_state_dict|save_state_dict)` is deprecated.*")
_warnings.filterwarnings("ignore", message=r"Please use DTensor instead.*")

__version__ = "0.1.0"
