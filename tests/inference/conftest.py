"""Shared fixtures of the sampler tests."""
import pytest
import torch


@pytest.fixture(scope="module")
def rand_model(mcore):
    """A tiny random-weight model with a large init std (context-dependent greedy outputs), vocab 61."""
    from setdiff_mega.config import ModelConfig
    from setdiff_mega.model import build_model

    torch.manual_seed(0)
    mc = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, zero_init_head=False, init_method_std=0.5,
                     make_vocab_size_divisible_by=8)
    return build_model(mc, 61).eval()
