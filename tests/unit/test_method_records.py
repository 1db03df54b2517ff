"""Methods passed as records (issue 58): the decoding trace reads whether a method decodes in blocks from its
registry record (or a record-like object: the export's, from config.json), never from a table of names; the
export finds its sampler by the name config.json records."""
import dataclasses

import pytest

from setdiff_mega import methods
from setdiff_mega.decoding import trace
from setdiff_mega.decoding.baselines import BD3LMSampler
from setdiff_mega.hfmodel.generation_setdlm import ExportedMethod, sampler_of

POSITIONS, STEPS = [5, 6, 7, 8, 9], [0, 0, 1, 2, 2]


def test_the_trace_window_follows_the_record_not_the_name():
    import setdiff_mega.diffusion  # noqa: F401  (registers the built-in methods)

    blocks = [4, 4, 4, 8, 8]                                   # block_size 4 from position 4 (start 4)
    windows = [5, 5, 7, 8, 8]                                  # the leftmost position still masked at its step
    assert trace.window_starts(POSITIONS, STEPS, methods.get("bd3lm"), 4, 4) == blocks
    assert trace.window_starts(POSITIONS, STEPS, "mdlm", 4, 4) == blocks          # a registered name
    assert trace.window_starts(POSITIONS, STEPS, "setdlm", 4, 4) == windows
    assert trace.window_starts(POSITIONS, STEPS, ExportedMethod("x", True), 4, 4) == blocks
    assert trace.window_starts(POSITIONS, STEPS, ExportedMethod("x", False), 4, 4) == windows
    toy = methods.register(dataclasses.replace(methods.get("mdlm"), name="toy_blocks"))
    try:
        assert trace.window_starts(POSITIONS, STEPS, "toy_blocks", 4, 4) == blocks
    finally:
        methods.unregister(toy.name)
    assert trace.window_starts(POSITIONS, STEPS, "toy_blocks", 4, 4) == windows   # forgotten with its record


def test_the_export_reads_its_method_and_sampler_from_config_json():
    assert ExportedMethod.of({"objective": "bd3lm", "block": True, "sampler": "BD3LMSampler"}) == \
        ExportedMethod("bd3lm", True)
    assert sampler_of({"sampler": "BD3LMSampler"}) is BD3LMSampler
    with pytest.raises(ValueError, match="'method.sampler' is 'Popen'.*re-export"):
        sampler_of({"sampler": "Popen"})
