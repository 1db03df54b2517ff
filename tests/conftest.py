"""Test configuration: offline environment, a single-rank megatron-core state, shared helpers."""
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import pytest  # noqa: E402
import torch  # noqa: E402

import setdiff_mega  # noqa: E402,F401  (installs the warning filters)
from setdiff_mega.compat import mcore_cpu  # noqa: E402

mcore_cpu.apply()            # what every entry point does first (megatron-core on a CPU-only torch)


@pytest.fixture(scope="session")
def mcore():
    """Initialise torch.distributed (1 rank, gloo) and megatron-core's parallel state once."""
    from setdiff_mega.parallel import initialize

    initialize(seed=1234)
    yield
    # left initialised for the session; the process exits afterwards


@pytest.fixture
def tiny_model(mcore):
    """A 2-layer random-weight model (non-zero head) in eval mode, vocab 61 (+ MASK = 60)."""
    from setdiff_mega.config import ModelConfig
    from setdiff_mega.model import build_model

    torch.manual_seed(0)
    mc = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, zero_init_head=False,
                     make_vocab_size_divisible_by=8)
    return build_model(mc, 61).eval()


MASK_ID = 60


def pytest_collection_modifyitems(session, config, items):
    """Tests that launch gloo ranks with the fork-based harness (their module imports ``run_ranks``) run
    first: once a test has initialised torch.distributed in the pytest process (the ``mcore`` fixture,
    in-process training in tests/e2e), the harness must spawn fresh interpreters instead, which costs
    seconds per rank. The order is otherwise kept."""
    items.sort(key=lambda item: 0 if getattr(getattr(item, "module", None), "run_ranks", None) else 1)
