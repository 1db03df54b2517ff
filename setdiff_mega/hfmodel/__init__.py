"""The Hugging Face model of the inference format: its configuration and modelling code, the glue that
runs :mod:`setdiff_mega.decoding`'s samplers over it, the fused decode step and its CUDA-graph capture, and
the export's checksums. Plain PyTorch + transformers + safetensors; every module here but this one (and
``cpu_kernels.cpp``, the C++ source of ``cpu_kernels``) is copied into every export together with
:mod:`setdiff_mega.decoding`'s, flattened into one directory (``checkpoint.hf.code_files``: ``from ..decoding.x
import`` becomes ``from .x import``), where ``trust_remote_code=True`` loads it.

    configuration_setdlm   SetDLMConfig (architecture, ``method``, the full training RunConfig)
    modeling_setdlm        the transformer (same function as setdiff_mega.model's), ``generate`` / ``infill``
    generation_setdlm      the samplers' model interface over it (DecodeModel), options, ``generate`` / ``infill``
    decode_step            one decode forward as a flat function over fused weights
    capture                CapturedStep: decode steps keyed by shape signature; CUDA graphs on CUDA
    integrity              SHA256SUMS: written at export, verified on load

Imports: torch, transformers, safetensors, this directory and ``..decoding`` (tests/unit/test_layering.py).
"""
