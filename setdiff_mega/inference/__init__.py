"""Inference front end: text requests -> the objective's sampler (:mod:`.api`), decoding options and
presets (:mod:`.options`), the decoding benchmark (:mod:`.benchmark`).

The samplers themselves (KV cache and context ledger, logits processors, stopping criteria, the SetDLM
sliding-window sampler and the baselines) live in :mod:`setdiff_mega.decoding`, which imports only
torch and transformers because it is copied verbatim into every Hugging Face export; they are re-exported
here.
"""
from setdiff_mega.decoding.base import Canvas, GenerationConfig, GenerationOutput
from setdiff_mega.decoding.baselines import ARSampler, BD3LMSampler, MDLMSampler
from setdiff_mega.decoding.cache import KVCache
from setdiff_mega.decoding.context import ContextOverflow, Ledger
from setdiff_mega.decoding.processors import LogitsPipeline
from setdiff_mega.decoding.sampling import choose_tokens, commit_mask
from setdiff_mega.decoding.setdlm import SetDLMSampler
from setdiff_mega.decoding.stopping import StopCriteria

from .api import RequestError, build_sampler, encode_request, generate

__all__ = ["generate", "encode_request", "build_sampler", "RequestError", "Canvas", "GenerationConfig",
           "GenerationOutput", "SetDLMSampler", "ARSampler", "BD3LMSampler", "MDLMSampler", "KVCache",
           "Ledger", "ContextOverflow", "LogitsPipeline", "StopCriteria", "choose_tokens", "commit_mask"]
