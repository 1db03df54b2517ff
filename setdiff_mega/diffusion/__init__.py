"""The set-diffusion core: schedules, orders, masks and objectives (pure torch, no parallelism).

Public API (stable names, listed in docs/guide/api.md):

* schedules: :class:`StaggeredSchedule` (``create``, ``alpha``, ``alpha_prime``,
  ``first_hitting_times``), :class:`LinearSchedule`
* orders: :func:`sample_order`, :func:`order_from_exponentials`, :func:`hitting_times`,
  :func:`move_eos_last`, :func:`invert`, :func:`permute`
* masks (True = allowed): :func:`setcausal_mask`, :func:`setcausal_mask_from_ranks`,
  :func:`block_diffusion_mask`, :func:`causal_mask`, :func:`bidirectional_mask`, :func:`with_key_padding`
* objectives: :func:`build_objective`, :class:`ARObjective`, :class:`MDLMObjective`,
  :class:`BD3LMObjective`, :class:`SetDLMObjective`, :class:`ModelInputs`, :func:`masked_token_nll`,
  :func:`inputs_for` (a :class:`~setdiff_mega.data.batch.Batch` -> model inputs)

Importing the package registers the built-in methods (each objective module registers its own record in
:mod:`setdiff_mega.methods`).
"""
from .masks import (
    bidirectional_mask,
    block_diffusion_mask,
    causal_mask,
    setcausal_mask,
    setcausal_mask_from_ranks,
    with_key_padding,
)
from .objectives import (
    ARObjective,
    BD3LMObjective,
    MDLMObjective,
    ModelInputs,
    Objective,
    SetDLMObjective,
    build_inputs_per_sample,
    build_objective,
    collate_inputs,
    inputs_for,
    masked_token_nll,
    objective_options,
    row_generator,
)
from .orders import (
    hitting_times,
    invert,
    move_eos_last,
    order_from_exponentials,
    order_from_times,
    permute,
    sample_exponentials,
    sample_order,
)
from .schedules import LinearSchedule, StaggeredSchedule, default_s_max, mean_lag_slots

__all__ = [
    "StaggeredSchedule", "LinearSchedule", "mean_lag_slots", "default_s_max",
    "sample_order", "order_from_exponentials", "order_from_times", "hitting_times", "sample_exponentials",
    "move_eos_last", "invert", "permute",
    "setcausal_mask", "setcausal_mask_from_ranks", "block_diffusion_mask", "causal_mask",
    "bidirectional_mask", "with_key_padding",
    "Objective", "ModelInputs", "inputs_for", "row_generator", "objective_options", "ARObjective", "MDLMObjective",
    "BD3LMObjective", "SetDLMObjective", "build_objective", "masked_token_nll", "collate_inputs",
    "build_inputs_per_sample",
]
