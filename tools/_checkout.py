"""Put the checkout's root on ``sys.path``: the studies (``experiments/``) and benchmarks (``benchmarks/``) are not
installed with the library, and a tool runs from the checkout (``python tools/NAME.py``)."""
import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[1])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
