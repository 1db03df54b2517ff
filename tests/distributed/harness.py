"""The fork-based gloo launcher the distributed tests use (it lives in the package:
:mod:`setdiff_mega.parallel.local`, also used by the local benchmarks)."""
from setdiff_mega.parallel.local import run_ranks

__all__ = ["run_ranks"]
