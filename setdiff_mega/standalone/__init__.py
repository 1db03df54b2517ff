"""The inference format's code: plain PyTorch + transformers, importing nothing else (not even this
package's other modules), and copied verbatim (every module here but this one) into every Hugging Face
export, where ``trust_remote_code=True`` loads it.

    configuration_setdlm   SetDLMConfig (architecture, ``method``, the full training RunConfig)
    modeling_setdlm        the transformer (same function as setdiff_mega.model's), ``generate`` / ``infill``
    generation_setdlm      the samplers' model interface over it, options, ``generate`` / ``infill``
    base, baselines, cache, context, processors, runner, sampling, setdlm, stopping
                           the samplers (SetDLM, AR, BD3LM, MDLM), KV cache, context ledger, processors and
                           stopping criteria, which the native path (setdiff_mega.inference) uses as well

So the exported model and the training stack decode with one implementation. Relative imports only,
and only to modules of this directory (tests/unit/test_layering.py checks it).
"""
