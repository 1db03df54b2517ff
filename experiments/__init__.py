"""Studies: the paper's claims at CPU scale (``paper``), the AR-to-SetDLM adaptation recipe (``adapt``).

Not part of the installed library (``setdiff_mega`` never imports it; ``tests/unit/test_layering.py`` checks):
each study composes the library's public pieces (training runs through ``setdiff_mega.train``, decoding
through ``setdiff_mega.inference``, scoring through ``setdiff_mega.eval`` and ``setdiff_mega.tasks``) into a
resumable experiment with its report. The thin entry points are ``tools/reproduce.py`` (which puts the
repository root on ``sys.path``, as they run from a checkout) and the tests.
"""
