"""Inference: KV cache and context ledger, logits processors, stopping criteria, the SetDLM sliding-window
sampler and the baselines."""
from .api import SAMPLERS, RequestError, build_sampler, encode_request, generate
from .base import Canvas, GenerationConfig, GenerationOutput
from .baselines import ARSampler, BD3LMSampler, MDLMSampler
from .cache import KVCache
from .context import ContextOverflow, Ledger
from .processors import LogitsPipeline
from .sampling import choose_tokens, commit_mask
from .setdlm import SetDLMSampler
from .stopping import StopCriteria

__all__ = ["generate", "encode_request", "build_sampler", "RequestError", "SAMPLERS", "Canvas", "GenerationConfig",
           "GenerationOutput", "SetDLMSampler", "ARSampler", "BD3LMSampler", "MDLMSampler", "KVCache",
           "Ledger", "ContextOverflow", "LogitsPipeline", "StopCriteria", "choose_tokens", "commit_mask"]
