"""Compatibility shims at the bottom of the import graph, applied explicitly by the entry points (the CLI
wrapper, ``parallel.initialize``, the local rank launcher, the test session), never as an import side
effect: :mod:`.mcore_cpu` (megatron-core 0.16.1 on a CPU-only torch)."""
