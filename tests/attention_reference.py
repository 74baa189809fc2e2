"""Paged attention written plainly in float64: what every kernel is checked against."""

from __future__ import annotations

import torch


def decode_reference(q, k_cache, v_cache, tables, lens, block_size, scale):
    """Each sequence's one query row over its `lens` cached tokens, in float64."""
    out = torch.empty(q.shape, dtype=torch.float64)
    group = q.shape[1] // k_cache.shape[1]
    for b, length in enumerate(lens.tolist()):
        slots = torch.arange(length)
        slots = tables[b, slots // block_size].long() * block_size + slots % block_size
        keys = k_cache[slots].double().repeat_interleave(group, dim=1)  # [T, H, D]
        values = v_cache[slots].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,thd->ht", q[b].double(), keys) * scale
        out[b] = torch.einsum("ht,thd->hd", scores.softmax(-1), values)
    return out


def prefill_reference(q, k_cache, v_cache, table, cached, block_size, scale):
    """Causal attention of q's rows (positions cached, cached + 1, ...) over the cache."""
    length = cached + q.shape[0]
    group = q.shape[1] // k_cache.shape[1]
    slots = torch.arange(length)
    slots = table[slots // block_size].long() * block_size + slots % block_size
    keys = k_cache[slots].double().repeat_interleave(group, dim=1)  # [T, H, D]
    values = v_cache[slots].double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,thd->hqt", q.double(), keys) * scale
    visible = torch.arange(length)[None, :] <= (cached + torch.arange(q.shape[0]))[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqt,thd->qhd", scores.softmax(-1), values)
