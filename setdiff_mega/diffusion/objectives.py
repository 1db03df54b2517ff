"""AR, MDLM, BD3LM and SetDLM as one family: the built-in objectives and the factory by name.

Each method lives in its own module with its options and its registry record (:mod:`.ar`, :mod:`.mdlm`,
:mod:`.bd3lm`, :mod:`.setdlm`); the interface, the inputs and the loss are in :mod:`.base`, batches -> inputs
in :mod:`.inputs` (packed rows: :mod:`.packing`). Layouts:

    objective | T   | tokens               | positions       | mask                 | logits on
    AR        | L-1 | x[:, :-1]            | 0..L-2          | causal               | all; predict x[:, 1:]
    MDLM      | L   | x_t (MASK w.p. t)    | 0..L-1          | bidirectional        | all; masked targets
    BD3LM     | 2L  | [x0 ; x_t] (t/block) | [0..L-1]*2      | block mask, size S   | noisy half
    SetDLM    | 2L  | [x0[perm] ; MASK..]  | [perm ; perm]   | static set-causal    | noisy half; no shift

With ``model.shift_logits`` (method.md 13) the diffusion objectives take logits on every row and each target
reads its predecessor's row where that is leak-free (``ModelInputs.logit_rows``); AR is unchanged.
"""
from __future__ import annotations

from setdiff_mega import methods

from .ar import ARObjective
from .base import ModelInputs, Objective, collate_inputs, masked_token_nll
from .bd3lm import BD3LMObjective
from .inputs import build_inputs_per_sample, inputs_for, row_generator
from .mdlm import MDLMObjective
from .setdlm import SetDLMObjective


def objective_options(name: str, fields: dict):
    """The options of method ``name`` from ``fields`` (the ``objective.*`` values; fields of other methods
    are ignored, as in a config)."""
    method = methods.get(name)
    own = {f for f in method.options.__dataclass_fields__}
    return method.make_options({k: v for k, v in fields.items() if k in own})


def build_objective(name: str, mask_id: int, *, eos_id: int | None = None, dense_masks: bool = True,
                    options=None, shift_logits: bool = False, **fields) -> Objective:
    """Factory by name through the method registry (:mod:`setdiff_mega.methods`): ``options`` (the method's
    Options) or ``fields`` (``objective.*`` values; each method takes the ones it has). ``dense_masks=False``:
    the inputs carry the mask's pattern only (context parallelism builds each rank's rows from it);
    ``shift_logits``: the AR head alignment (``model.shift_logits``, method.md 13)."""
    try:
        method = methods.get(name)
    except methods.MethodError:
        raise ValueError(f"unknown objective {name!r}; choose one of {', '.join(methods.names())}") from None
    obj = method.build(options if options is not None else objective_options(name, fields), mask_id, eos_id)
    obj.dense_masks = bool(dense_masks)
    obj.shift_logits = bool(shift_logits)
    return obj


__all__ = ["ModelInputs", "collate_inputs", "build_inputs_per_sample", "inputs_for", "row_generator", "Objective",
           "ARObjective", "MDLMObjective", "BD3LMObjective", "SetDLMObjective", "build_objective",
           "objective_options", "masked_token_nll"]
