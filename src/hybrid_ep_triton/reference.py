"""Plain-torch reference for expert-parallel dispatch / combine.

This module is the test oracle for the library's Triton kernels and the NCCL baseline in the
benchmark. It uses only ``torch`` and ``torch.distributed`` collectives (``all_to_all_single``
with split sizes), never the library's kernels, and it has no Python loops over tokens.

Layout conventions (``W`` ranks, ``num_experts = W * L``; rank ``r`` owns the global experts
``[r * L, (r + 1) * L)``):

* **dispatch** sends every token once to each rank that owns at least one of its top-k experts,
  together with its top-k ids (and weights). The receiver expands each received token into one
  row per local expert it selected. ``recv_x`` rows are grouped by local expert ``0..L-1``;
  inside one expert they are ordered by source rank, then by source token index. Each expert's
  segment may be padded with zero rows to a multiple of ``pad_multiple``, and the whole buffer
  may be fixed to ``max_recv_tokens`` rows (zero tail, or truncation of the exact layout).
* with ``expand=False`` **dispatch** keeps one row per received token instead (ordered by source
  rank, then source token index) with the token's local expert ids and weights packed in slot
  order beside it, as DeepEP's dispatch returns it; combine then treats every row as one
  (token, expert) pair.
* **combine** is the reverse path: the expert rank reduces the rows of each received token into
  one float32 partial per (token, source rank), sends the partials back, and the token's rank
  sums them in float32 (in rank order) and casts to ``y``'s dtype.

Both functions are collective: every rank of ``group`` must call them, in the same order.
Works with gloo (CPU tensors) and NCCL (CUDA tensors).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = [
    "ReferenceHandle",
    "combine",
    "dequantize_fp8",
    "dispatch",
    "quantize_fp8",
    "tokens_routed_per_local_expert",
]


@dataclass
class ReferenceHandle:
    """What :func:`combine` needs to undo one :func:`dispatch`.

    Attributes:
        num_tokens: ``T``, tokens of this rank (rows of ``x`` and of combine's output).
        send_token_idx: ``[S]`` int64, source token index of each row this rank sent, grouped
            by destination rank (ascending), ascending token index within a destination.
        send_splits: rows sent to each rank (length ``W``, sums to ``S``).
        recv_splits: rows received from each rank (length ``W``, sums to ``R``).
        slot_row: ``[R, K]`` int64; for received token ``i`` and top-k slot ``k``, the row of
            ``recv_x`` that holds this (token, expert) pair, or -1 if that slot names no expert of
            this rank or its row was dropped by ``max_recv_tokens`` truncation.
        num_recv_rows: rows of the exact (padded, untruncated) layout. Larger than
            ``recv_x.shape[0]`` exactly when ``max_recv_tokens`` truncated the output.
    """

    num_tokens: int
    send_token_idx: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]
    slot_row: torch.Tensor
    num_recv_rows: int


def _all_to_all(
    group: dist.ProcessGroup | None,
    send: torch.Tensor,
    send_splits: list[int],
    recv_splits: list[int],
) -> torch.Tensor:
    """Exchange rows along dim 0 with uneven splits.

    The first ``send_splits[0]`` rows of ``send`` go to rank 0, the next ``send_splits[1]`` to
    rank 1, and so on; the result holds ``recv_splits[r]`` rows from each rank ``r``, in rank
    order. Gloo (torch >= 2.x) and NCCL both implement uneven ``all_to_all_single`` for every
    dtype used here, bf16 included, so no fallback path is needed.
    """
    recv = send.new_empty((sum(recv_splits), *send.shape[1:]))
    dist.all_to_all_single(recv, send.contiguous(), recv_splits, send_splits, group=group)
    return recv


def dispatch(
    group: dist.ProcessGroup | None,
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor | None = None,
    *,
    num_experts: int,
    pad_multiple: int = 1,
    max_recv_tokens: int | None = None,
    expand: bool = True,
) -> tuple:
    """Send each token to the ranks owning its experts and expand it per local expert.

    Args:
        group: process group of ``W`` ranks (None: the default group).
        x: ``[T, H]`` bf16 / fp16 / fp32 tokens of this rank (``T`` may be 0 and may differ
            between ranks).
        topk_idx: ``[T, K]`` int32 or int64 global expert ids; -1 marks an unused slot. Ids
            within a row must be distinct.
        topk_weights: ``[T, K]`` float32 routing weights, or None.
        num_experts: total experts, a multiple of ``W``; each rank owns ``L = num_experts // W``.
        pad_multiple: pad every local expert's segment with zero rows to a multiple of this.
        max_recv_tokens: None for an exactly sized output; otherwise the output has exactly
            this many rows: a zero tail if the exact layout is shorter, or the first
            ``max_recv_tokens`` rows of the exact layout if it is longer.

    Returns:
        ``(recv_x, recv_weights, tokens_per_expert, handle)``:

        * ``recv_x``: ``[N, H]`` ``x.dtype``; rows grouped by local expert, then source rank,
          then source token index; padding and tail rows are zero.
        * ``recv_weights``: ``[N]`` float32 weight of each row's (token, expert) pair, 0 for
          padding / tail rows; None if ``topk_weights`` is None.
        * ``tokens_per_expert``: ``[L]`` int64 on ``x.device``, rows of each expert's segment in
          ``recv_x``, padding included. Under truncation these are clipped to the returned
          rows, so they always sum to at most ``N`` and describe ``recv_x`` as returned.
        * ``handle``: :class:`ReferenceHandle` for :func:`combine`.

        With ``expand=False`` (``pad_multiple`` must be 1): ``(recv_x, recv_topk_idx,
        recv_topk_weights, tokens_per_expert, handle)``: ``recv_x`` ``[N, H]`` one row per
        received token (zero tail / truncation as above), ``recv_topk_idx`` ``[N, K]`` int32
        local expert ids of the row's slots on this rank in slot order, then -1,
        ``recv_topk_weights`` ``[N, K]`` float32 their weights, then 0 (None without
        ``topk_weights``), and ``tokens_per_expert`` the (token, expert) pairs of each local
        expert among all received tokens.
    """
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if num_experts < world or num_experts % world != 0:
        raise ValueError(f"num_experts={num_experts} is not a positive multiple of world={world}")
    if x.dim() != 2 or topk_idx.dim() != 2 or topk_idx.shape[0] != x.shape[0]:
        raise ValueError(f"expected x [T, H] and topk_idx [T, K], got {x.shape}, {topk_idx.shape}")
    if topk_weights is not None and topk_weights.shape != topk_idx.shape:
        raise ValueError(f"topk_weights {topk_weights.shape} != topk_idx {topk_idx.shape}")
    if pad_multiple < 1 or (max_recv_tokens is not None and max_recv_tokens < 0):
        raise ValueError(f"bad pad_multiple={pad_multiple} / max_recv_tokens={max_recv_tokens}")
    if not expand and pad_multiple != 1:
        raise ValueError(f"pad_multiple must be 1 with expand=False, got {pad_multiple}")
    num_local = num_experts // world
    device = x.device
    num_tokens = topk_idx.shape[0]
    idx = topk_idx.to(torch.int64)
    # Out-of-range ids would otherwise be dropped silently, which an oracle must not do.
    if idx.numel() and (int(idx.min()) < -1 or int(idx.max()) >= num_experts):
        raise ValueError(f"topk_idx has ids outside [-1, {num_experts})")

    # --- sender: one row per (token, destination rank that owns one of its experts) ---------
    dest_rank = torch.where(idx >= 0, idx // num_local, -1)  # [T, K]
    ranks = torch.arange(world, device=device)
    goes_to = (dest_rank.unsqueeze(-1) == ranks).any(dim=1)  # [T, W]
    # nonzero over the [W, T] view is row-major: grouped by rank, token index ascending within.
    _, send_token_idx = goes_to.t().nonzero(as_tuple=True)
    send_counts = goes_to.sum(dim=0)  # [W] int64
    ones = [1] * world
    recv_counts = _all_to_all(group, send_counts, ones, ones)
    send_splits = send_counts.tolist()
    recv_splits = recv_counts.tolist()

    recv_tok_x = _all_to_all(group, x[send_token_idx], send_splits, recv_splits)  # [R, H]
    recv_idx = _all_to_all(group, idx[send_token_idx], send_splits, recv_splits)  # [R, K]
    recv_w = None
    if topk_weights is not None:
        send_w = topk_weights.to(torch.float32)[send_token_idx]
        recv_w = _all_to_all(group, send_w, send_splits, recv_splits)  # [R, K]
    # Received rows are ordered by source rank, then source token index (sender order).

    # --- receiver: expand into (token, local expert) pairs ordered by expert -----------------
    local = recv_idx - rank * num_local
    # -1 slots map below 0, other ranks' experts outside [0, L): one test covers both.
    mine = (local >= 0) & (local < num_local)
    if expand:
        outputs, slot_row, num_recv_rows = _expert_rows(
            recv_tok_x, local, mine, recv_w, num_local, pad_multiple, max_recv_tokens
        )
    else:
        outputs, slot_row, num_recv_rows = _token_rows(
            recv_tok_x, local, mine, recv_w, num_local, max_recv_tokens
        )
    handle = ReferenceHandle(
        num_tokens=num_tokens,
        send_token_idx=send_token_idx,
        send_splits=send_splits,
        recv_splits=recv_splits,
        slot_row=slot_row,
        num_recv_rows=num_recv_rows,
    )
    return (*outputs, handle)


def _expert_rows(recv_tok_x, local, mine, recv_w, num_local, pad_multiple, max_recv_tokens):
    """(recv_x, recv_weights, tokens_per_expert), slot_row and the exact row count of the
    expert-major output, from the received tokens [R, H], their local expert ids [R, K] and
    which of them are this rank's (``mine``), their weights [R, K] or None."""
    device = local.device
    pair_tok, pair_slot = mine.nonzero(as_tuple=True)  # ordered by received row
    pair_expert = local[pair_tok, pair_slot]
    # A stable sort by expert keeps the (source rank, source token) order inside each expert.
    pair_expert, order = torch.sort(pair_expert, stable=True)
    pair_tok, pair_slot = pair_tok[order], pair_slot[order]

    counts = torch.bincount(pair_expert, minlength=num_local)  # [L]
    padded = (counts + pad_multiple - 1) // pad_multiple * pad_multiple
    padded_end = padded.cumsum(0)
    padded_start = padded_end - padded
    unpadded_start = counts.cumsum(0) - counts
    # Position of a pair inside its expert's segment, shifted to the padded segment start.
    pos_in_expert = torch.arange(pair_expert.numel(), device=device) - unpadded_start[pair_expert]
    pair_row = padded_start[pair_expert] + pos_in_expert

    num_recv_rows = int(padded_end[-1])
    num_rows = num_recv_rows if max_recv_tokens is None else max_recv_tokens
    keep = pair_row < num_rows
    pair_tok, pair_slot, pair_row = pair_tok[keep], pair_slot[keep], pair_row[keep]

    recv_x = recv_tok_x.new_zeros((num_rows, recv_tok_x.shape[1]))
    recv_x[pair_row] = recv_tok_x[pair_tok]
    recv_weights = None
    if recv_w is not None:
        recv_weights = torch.zeros(num_rows, dtype=torch.float32, device=device)
        recv_weights[pair_row] = recv_w[pair_tok, pair_slot]
    tokens_per_expert = padded_end.clamp(max=num_rows) - padded_start.clamp(max=num_rows)

    slot_row = torch.full_like(local, -1)
    slot_row[pair_tok, pair_slot] = pair_row
    return (recv_x, recv_weights, tokens_per_expert), slot_row, num_recv_rows


def _token_rows(recv_tok_x, local, mine, recv_w, num_local, max_recv_tokens):
    """The same with one row per received token: (recv_x, recv_topk_idx, recv_topk_weights,
    tokens_per_expert), slot_row, row count."""
    num_recv = recv_tok_x.shape[0]
    num_rows = num_recv if max_recv_tokens is None else max_recv_tokens
    keep = min(num_rows, num_recv)
    # Local slots first, each group in slot order (a stable sort).
    order = torch.sort((~mine).to(torch.int32), dim=1, stable=True).indices
    packed = mine.gather(1, order)
    recv_x = recv_tok_x.new_zeros((num_rows, recv_tok_x.shape[1]))
    recv_x[:keep] = recv_tok_x[:keep]
    recv_idx = torch.full((num_rows, local.shape[1]), -1, dtype=torch.int32, device=local.device)
    recv_idx[:keep] = torch.where(packed, local.gather(1, order), -1)[:keep].to(torch.int32)
    recv_weights = None
    if recv_w is not None:
        recv_weights = torch.zeros(recv_idx.shape, dtype=torch.float32, device=local.device)
        recv_weights[:keep] = torch.where(packed, recv_w.gather(1, order), 0.0)[:keep]
    tokens_per_expert = torch.bincount(local[mine], minlength=num_local)
    # For combine: a row is one (token, expert) pair, in slot 0.
    slot_row = torch.full_like(local, -1)
    slot_row[:keep, 0] = torch.arange(keep, device=local.device)
    return (recv_x, recv_idx, recv_weights, tokens_per_expert), slot_row, num_recv


def combine(
    group: dist.ProcessGroup | None,
    y: torch.Tensor,
    handle: ReferenceHandle,
    *,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce expert outputs back onto the tokens' ranks (reverse of :func:`dispatch`).

    Args:
        group: the process group used for the matching :func:`dispatch`.
        y: ``[N, H]`` expert outputs in ``recv_x``'s row order (any float dtype).
        handle: the handle returned by that :func:`dispatch`.
        weights: ``[N]`` float32 per-row weights (e.g. ``recv_weights``), or None for 1.

    Returns:
        ``[T, H]`` ``y.dtype``: ``out[t] = sum over t's valid slots of weight * y[row]``,
        accumulated in float32. Padding rows and rows dropped by truncation contribute nothing;
        a token without any valid slot gets zeros.
    """
    world = dist.get_world_size(group)
    hidden = y.shape[1]
    num_recv, topk = handle.slot_row.shape

    # Expert side: one float32 partial per received token, accumulated in slot order. Each
    # token appears at most once per slot, so every index_add_ hits distinct rows
    # (deterministic even with GPU atomics).
    partial = torch.zeros((num_recv, hidden), dtype=torch.float32, device=y.device)
    for k in range(topk):
        rows = handle.slot_row[:, k]
        tok = (rows >= 0).nonzero(as_tuple=True)[0]
        contrib = y[rows[tok]].to(torch.float32)
        if weights is not None:
            contrib = contrib * weights[rows[tok]].to(torch.float32).unsqueeze(1)
        partial.index_add_(0, tok, contrib)

    # Partials travel the reverse route: what was received from rank r goes back to rank r.
    back = _all_to_all(group, partial, handle.recv_splits, handle.send_splits)  # [S, H] fp32

    # Token side: add each rank's partials in rank order; a token appears at most once per
    # rank's segment, so each index_add_ again hits distinct rows.
    out = torch.zeros((handle.num_tokens, hidden), dtype=torch.float32, device=y.device)
    start = 0
    for src in range(world):
        end = start + handle.send_splits[src]
        out.index_add_(0, handle.send_token_idx[start:end], back[start:end])
        start = end
    return out.to(y.dtype)


# -- FP8 rows -------------------------------------------------------------------------------

FP8_GROUP = 128  # channels per scale
E4M3_MAX = 448.0  # largest float8_e4m3fn value
AMAX_FLOOR = 2.0**-119  # the smallest power of two whose 448 / amax is finite in float32


def tokens_routed_per_local_expert(
    group: dist.ProcessGroup | None, topk_idx: torch.Tensor, num_experts: int
) -> torch.Tensor:
    """Collective: int64 [L] on the CPU, the (token, expert) slots of every rank's ``topk_idx``
    ([T, K], -1 for none, on a device the group reduces on) that name each of this rank's
    L = num_experts / world experts: what a dispatch adds into ``expert_recv_stats``."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    ids = topk_idx.flatten().long()
    counts = torch.bincount(ids[ids >= 0], minlength=num_experts)
    dist.all_reduce(counts, group=group)
    local = num_experts // world
    return counts[rank * local : (rank + 1) * local].cpu()


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [T, H] (H % 128 == 0) as (values [T, H] float8_e4m3fn, scales [T, H / 128]
    float32), one scale per token and 128 consecutive channels. With amax the block's largest
    magnitude and a = max(amax, 2^-119): value = x * (448 / a) rounded to the nearest e4m3
    value (ties to even), saturated at +-448; scale = a / 448, or 0 for a block of zeros (values
    0). DeepEP's per_token_cast_to_fp8 with a floor of 2^-119 instead of 1e-4 on amax.
    Dequantized: value * scale (``dequantize_fp8``)."""
    num_tokens, hidden = x.shape
    if hidden % FP8_GROUP:
        raise ValueError(f"FP8 rows need a hidden size that is a multiple of 128, got {hidden}")
    blocks = x.float().reshape(num_tokens, hidden // FP8_GROUP, FP8_GROUP)
    amax = blocks.abs().amax(dim=2)
    floored = amax.clamp(min=AMAX_FLOOR)
    e4m3_max = torch.full_like(amax, E4M3_MAX)
    # Tensor operands: CUDA torch divides by a scalar as a product with its reciprocal, which
    # is not always the IEEE quotient.
    scales = (floored / e4m3_max).masked_fill_(amax == 0, 0.0)
    ratio = blocks * (e4m3_max / floored)[:, :, None]
    values = ratio.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return values.reshape(num_tokens, hidden), scales


def dequantize_fp8(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 [T, H] from FP8 rows: values [T, H] float8_e4m3fn times their scales [T, H / 128]."""
    num_tokens, hidden = values.shape
    blocks = values.float().reshape(num_tokens, hidden // FP8_GROUP, FP8_GROUP)
    return (blocks * scales[:, :, None]).reshape(num_tokens, hidden)
