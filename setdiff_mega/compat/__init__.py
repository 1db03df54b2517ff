"""Compatibility shims at the bottom of the import graph, applied explicitly, never as an import side
effect: :mod:`.mcore_cpu` (megatron-core 0.16.1 on a CPU-only torch), applied by
``setdiff_mega.parallel.initialize`` (the gateway every path that builds a model or uses megatron-core's
parallel state goes through), the local rank launcher and the test session."""
