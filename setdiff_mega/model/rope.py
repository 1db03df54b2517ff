"""Rotary embeddings at arbitrary per-sample position ids.

megatron-core's GPTModel builds RoPE from the sequence length only (positions 0..s-1) and ignores
``position_ids``. SetDLM needs the ORIGINAL position of every (permuted) token, and inference needs
positions that start anywhere. This wraps mcore's ``RotaryEmbedding`` (which owns inv_freq, base,
rotary_percent and interpolation) and gathers its frequency table per sample:

    table = RotaryEmbedding(max_pos)            # [P, 1, 1, d]  (d = rotary dim, rotate-half layout)
    freqs = table[position_ids.T]               # [s, b, 1, d]  fed to TransformerBlock(rotary_pos_emb=...)

mcore's ``apply_rotary_pos_emb`` broadcasts freqs [s, b, 1, d] against q/k [s, b, h, d].

With ``scaling`` (Hugging Face's ``rope_scaling`` dict; Llama 3's rule) the inverse frequencies are the
export's own (:func:`setdiff_mega.hfmodel.decode_step.inverse_frequencies`), so both engines rotate by
the same angles.
"""
from __future__ import annotations

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

from setdiff_mega.hfmodel.decode_step import inverse_frequencies


class PerSampleRotary(torch.nn.Module):
    """RoPE frequencies gathered at per-sample positions; the table grows on demand."""

    def __init__(self, kv_channels: int, rotary_percent: float = 1.0, rotary_base: float = 10000.0,
                 seq_len_interpolation_factor: float | None = None, initial_positions: int = 1024,
                 scaling: dict | None = None):
        super().__init__()
        self.rotary = RotaryEmbedding(kv_channels=kv_channels, rotary_percent=rotary_percent,
                                      rotary_base=rotary_base,
                                      seq_len_interpolation_factor=seq_len_interpolation_factor,
                                      use_cpu_initialization=True)
        if scaling is not None:
            dim = int(kv_channels * rotary_percent) if rotary_percent < 1.0 else kv_channels
            self.rotary.inv_freq = inverse_frequencies(dim, rotary_base, scaling)
        self._table: torch.Tensor | None = None
        self._initial = int(initial_positions)

    def table(self, n: int, device) -> torch.Tensor:
        if self._table is None or self._table.shape[0] < n or self._table.device != torch.device(device):
            size = max(n, self._initial if self._table is None else 2 * self._table.shape[0])
            self._table = self.rotary.get_emb(size).to(device)        # [P, 1, 1, d]
        return self._table

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        """position_ids [b, s] (long) -> freqs [s, b, 1, d]."""
        if position_ids.min() < 0:
            raise ValueError("position ids must be non-negative")
        tab = self.table(int(position_ids.max()) + 1, position_ids.device)
        return tab[position_ids.t()].squeeze(2)


__all__ = ["PerSampleRotary"]
