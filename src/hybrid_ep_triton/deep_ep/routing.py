"""HybridEP's rows and routing as the native Buffer takes and gives them: FP8 hidden with its
scales, per-slot values scattered to experts, and HybridEP's ``indices_to_map``."""

from __future__ import annotations

import torch

from .. import Buffer
from ..runtime.checks import describe

FP8_DTYPES = (torch.float8_e4m3fn, torch.uint8)  # HybridEP's FP8 rows: e4m3, or their bytes

__all__ = ["hybrid_rows", "indices_to_map", "received_values", "scatter_slots"]


def hybrid_rows(hidden: torch.Tensor, scaling_factor: torch.Tensor | None):
    """hidden as the Buffer takes it: contiguous rows, or an FP8 pair (values, scales)."""
    hidden = hidden.detach().contiguous()
    if (scaling_factor is None) == (hidden.dtype in FP8_DTYPES):
        raise ValueError(
            f"{hidden.dtype} hidden with scaling_factor {describe(scaling_factor)}: "
            "FP8 hidden (float8_e4m3fn or uint8) goes with its scales"
        )
    if scaling_factor is None:
        return hidden
    return hidden.view(torch.float8_e4m3fn), scaling_factor.detach().float().contiguous()


def received_values(recv, hidden: torch.Tensor):
    """(received values in hidden's dtype, received scales or None)."""
    values, scales = recv if isinstance(recv, tuple) else (recv, None)
    return values.view(hidden.dtype), scales


def scatter_slots(per_slot, slots, num_experts):
    """[T, K] per-slot values to [T, E] at each slot's expert (-1 slots dropped)."""
    columns = torch.where(slots >= 0, slots.long(), num_experts)
    full = per_slot.new_zeros(slots.shape[0], num_experts + 1)
    full.scatter_(1, columns, torch.where(slots >= 0, per_slot, 0.0))
    return full[:, :num_experts]


def indices_to_map(topk_idx, topk_weights, num_of_tokens: int, num_of_experts: int):
    """HybridEP's conversion of top-k routing to a routing map, on topk_idx's device.

    Args:
        topk_idx: [T, K] int64 (or int32) global expert ids, -1 for an unused slot (skipped).
        topk_weights: [T, K] probs of those slots, or None.
        num_of_tokens: rows of the outputs, at least T (rows past T route nowhere).
        num_of_experts: E.

    Returns: routing_map [num_of_tokens, E] bool, probs [num_of_tokens, E] of topk_weights'
    dtype (0 where not routed) or None.
    """
    extra = num_of_tokens - topk_idx.shape[0]
    if extra < 0:
        raise ValueError(f"num_of_tokens {num_of_tokens} is less than topk_idx's {len(topk_idx)}")
    topk_idx = torch.cat([topk_idx, topk_idx.new_full((extra, topk_idx.shape[1]), -1)])
    routing_map = Buffer.token_counts(topk_idx, num_of_experts, num_of_experts)[3]  # one a "rank"
    if topk_weights is None:
        return routing_map, None
    topk_weights = torch.cat([topk_weights, topk_weights.new_zeros(extra, topk_idx.shape[1])])
    return routing_map, scatter_slots(topk_weights, topk_idx, num_of_experts)
