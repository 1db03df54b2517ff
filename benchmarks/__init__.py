"""Benchmarks of the training path: the step of every method and backend (``training``, ``tools/bench_train_gpu.py``),
the gradient reduction (``grad_reduce``, ``tools/bench_grad_reduce.py``) and supervised packing (``packing``,
``tools/bench_packing.py``). Not part of the installed library (``setdiff_mega`` never imports it); the tools put
the repository root on ``sys.path``."""
