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
  rank, then source token index) with the token's local expert ids and weights in their slot
  positions beside it (-1 and 0 at the slots of other ranks' experts), and each row's source
  token index, as DeepEP's dispatch returns them; combine then treats every row as one
  (token, expert) pair, and can sum per-slot weights back to the tokens as DeepEP's does.
* **combine** is the reverse path: the expert rank reduces the rows of each received token into
  one float32 partial per (token, source rank), sends the partials back, and the token's rank
  sums them in float32 (in rank order) and casts to ``y``'s dtype.

Both functions are collective: every rank of ``group`` must call them, in the same order.
Works with gloo (CPU tensors) and NCCL (CUDA tensors).

The low-latency mode's reference (``low_latency_dispatch`` / ``low_latency_combine``, DeepEP
V1's calls) is not collective: it takes every rank's inputs as lists and computes, on the CPU
with plain loops over (expert, source, token), what one rank receives.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = [
    "LowLatencyDispatch",
    "ReferenceHandle",
    "combine",
    "dequantize_fp8",
    "dequantize_mxfp8",
    "dequantize_nvfp4",
    "dispatch",
    "low_latency_combine",
    "low_latency_dispatch",
    "low_latency_token_slots",
    "quantize_fp8",
    "quantize_fp8_low_latency",
    "quantize_mxfp8",
    "quantize_nvfp4",
    "to_blocked_scales",
    "tokens_routed_per_local_expert",
    "ue8m0_bytes",
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
        recv_src_idx: with ``expand=False``, ``[N]`` int32: each row's source token index (-1
            past the received rows); None with expert-major rows.
    """

    num_tokens: int
    send_token_idx: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]
    slot_row: torch.Tensor
    num_recv_rows: int
    recv_src_idx: torch.Tensor | None = None


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

        With ``expand=False``: ``(recv_x, recv_topk_idx, recv_topk_weights, tokens_per_expert,
        handle)``: ``recv_x`` ``[N, H]`` one row per received token (zero tail / truncation as
        above), ``recv_topk_idx`` ``[N, K]`` of ``topk_idx``'s dtype, slot k the local expert id
        of the token's expert k where it lives on this rank, else -1, ``recv_topk_weights``
        ``[N, K]`` float32 their weights, 0 at the -1 slots (None without ``topk_weights``),
        ``tokens_per_expert`` the (token, expert) pairs of each local expert among all received
        tokens, each rounded up to a multiple of ``pad_multiple``, and the handle's
        ``recv_src_idx``.
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
            recv_tok_x, local, mine, recv_w, num_local, pad_multiple, max_recv_tokens
        )
        recv_idx_dtype = outputs[1].to(topk_idx.dtype)
        outputs = (outputs[0], recv_idx_dtype, *outputs[2:])
        recv_src = _all_to_all(group, send_token_idx, send_splits, recv_splits)
        recv_src_idx = torch.full((outputs[0].shape[0],), -1, dtype=torch.int32, device=device)
        keep = min(recv_src_idx.shape[0], recv_src.shape[0])
        recv_src_idx[:keep] = recv_src[:keep].to(torch.int32)
    handle = ReferenceHandle(
        num_tokens=num_tokens,
        send_token_idx=send_token_idx,
        send_splits=send_splits,
        recv_splits=recv_splits,
        slot_row=slot_row,
        num_recv_rows=num_recv_rows,
        recv_src_idx=None if expand else recv_src_idx,
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


def _token_rows(recv_tok_x, local, mine, recv_w, num_local, pad_multiple, max_recv_tokens):
    """The same with one row per received token: (recv_x, recv_topk_idx (int64),
    recv_topk_weights, tokens_per_expert), slot_row, row count."""
    num_recv = recv_tok_x.shape[0]
    num_rows = num_recv if max_recv_tokens is None else max_recv_tokens
    keep = min(num_rows, num_recv)
    recv_x = recv_tok_x.new_zeros((num_rows, recv_tok_x.shape[1]))
    recv_x[:keep] = recv_tok_x[:keep]
    recv_idx = torch.full((num_rows, local.shape[1]), -1, dtype=torch.int64, device=local.device)
    recv_idx[:keep] = torch.where(mine, local, -1)[:keep]
    recv_weights = None
    if recv_w is not None:
        recv_weights = torch.zeros(recv_idx.shape, dtype=torch.float32, device=local.device)
        recv_weights[:keep] = torch.where(mine, recv_w, 0.0)[:keep]
    counts = torch.bincount(local[mine], minlength=num_local)
    tokens_per_expert = (counts + pad_multiple - 1) // pad_multiple * pad_multiple
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
    topk_weights: torch.Tensor | None = None,
):
    """Reduce expert outputs back onto the tokens' ranks (reverse of :func:`dispatch`).

    Args:
        group: the process group used for the matching :func:`dispatch`.
        y: ``[N, H]`` expert outputs in ``recv_x``'s row order (any float dtype).
        handle: the handle returned by that :func:`dispatch`.
        weights: ``[N]`` float32 per-row weights (e.g. ``recv_weights``), or None for 1.
        topk_weights: with ``expand=False``, ``[N, K]`` float32 per-slot values of the rows
            (e.g. ``recv_topk_weights``), or None.

    Returns:
        ``[T, H]`` ``y.dtype``: ``out[t] = sum over t's valid slots of weight * y[row]``,
        accumulated in float32. Padding rows and rows dropped by truncation contribute nothing;
        a token without any valid slot gets zeros. With ``topk_weights`` also ``[T, K]``
        float32: each token's sum of ``topk_weights`` over its rows (every slot position).
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
    out = _sum_back(group, partial, handle, world).to(y.dtype)
    if topk_weights is None:
        return out
    # A token row is one received token (slot 0 of slot_row holds its row).
    rows = handle.slot_row[:, 0]
    slot_partial = torch.zeros((num_recv, topk), dtype=torch.float32, device=y.device)
    kept = rows >= 0
    slot_partial[kept] = topk_weights[rows[kept]].to(torch.float32)
    return out, _sum_back(group, slot_partial, handle, world)


def _sum_back(group, partial: torch.Tensor, handle: ReferenceHandle, world: int) -> torch.Tensor:
    """[T, C] float32: every rank's float32 partials [R, C] of this rank's tokens, sent back
    along the reverse route and summed per token in rank order."""
    # Partials travel the reverse route: what was received from rank r goes back to rank r.
    back = _all_to_all(group, partial, handle.recv_splits, handle.send_splits)  # [S, C] fp32

    # Token side: add each rank's partials in rank order; a token appears at most once per
    # rank's segment, so each index_add_ again hits distinct rows.
    out = torch.zeros(
        (handle.num_tokens, partial.shape[1]), dtype=torch.float32, device=partial.device
    )
    start = 0
    for src in range(world):
        end = start + handle.send_splits[src]
        out.index_add_(0, handle.send_token_idx[start:end], back[start:end])
        start = end
    return out


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


# -- Block-scaled rows of Blackwell's GEMMs: MXFP8 and NVFP4 ---------------------------------
#
# Both quantizers follow torchao 0.18 (torchao/prototype/mx_formats) step by step, so that a
# block-scaled dispatch gives what torchao's own quantization of the same rows gives: MXFP8 is
# ``mx_tensor.to_mx(x, torch.float8_e4m3fn, 32, ScaleCalculationMode.FLOOR)``, NVFP4 is
# ``nvfp4_tensor.nvfp4_quantize(x, 16, per_tensor_scale)``. Every division here has tensor
# operands: CUDA torch divides by a Python scalar as a product with its reciprocal, which is not
# always the IEEE quotient that torchao's code computes on the CPU (and the kernels compute).
#
# Scales are row-major, one row of scales per token row ([T, H / block]): what a dispatch moves
# with its row, and what it emits. ``to_blocked_scales`` rearranges them into the 128x4 tiled
# layout that cuBLAS / CUTLASS block-scaled GEMMs (torch._scaled_mm) read.

MX_BLOCK = 32  # channels per E8M0 scale (MXFP8)
NVFP4_BLOCK = 16  # channels per e4m3 scale (NVFP4)
E4M3_EMAX = 8  # exponent of e4m3's largest power of two, 256 (torchao's F8E4M3_MAX_POW2)
E8M0_BIAS = 127
E8M0_NAN = 255
F32_MIN_NORMAL = 2.0**-126  # torchao's floor on the MXFP8 divisor (constants.F32_MIN_NORMAL)
E4M3_TINY = 2.0**-6  # smallest normal e4m3 value: the floor on an NVFP4 block scale (E4M3_EPS)
E2M1_MAX = 6.0  # largest e2m1 value
# The e2m1 value of each nibble: 0..7 positive, 8..15 their negatives (8: -0.0).
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _blocks(x: torch.Tensor, block: int, name: str) -> torch.Tensor:
    """``x`` [T, H] as float32 [T, H / block, block]; ValueError unless H % block == 0."""
    if x.dim() != 2:
        raise ValueError(f"{name} quantizes rows [T, H], got shape {tuple(x.shape)}")
    num_tokens, hidden = x.shape
    if hidden % block:
        raise ValueError(
            f"{name} rows need a hidden size that is a multiple of {block}, got {hidden}"
        )
    return x.float().reshape(num_tokens, hidden // block, block)


def quantize_mxfp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8 (OCP MX v1.0) rows: ``x`` [T, H] bf16 / fp16 / fp32 (H % 32 == 0, else ValueError)
    as (values [T, H] float8_e4m3fn, scales [T, H / 32] float8_e8m0fnu), one power-of-two scale
    per token and 32 consecutive channels, row-major.

    torchao's ``to_mx(x, torch.float8_e4m3fn, 32, ScaleCalculationMode.FLOOR)``
    (prototype/mx_formats/mx_tensor.py), computed in float32:

    * amax: the block's largest magnitude (NaN if the block holds a NaN);
    * scale exponent e = (exponent field of amax's float32 bits) - 127 - 8, i.e. floor(log2
      amax) - emax(e4m3) for a normal amax, clamped to [-127, 128]; E8M0 byte e + 127 (0 for a
      block of zeros or of float32 subnormals; 247 for an infinite amax), 255 for a block with a
      NaN;
    * value = x / d saturated to +-448 and rounded to the nearest e4m3 value, ties to even,
      where d = max(2^(byte - 127), 2^-126) as float32: torchao's floor on the divisor, so a
      block with byte 0 is divided by 2^-126 although its scale reads 2^-127 (only blocks with
      amax below 2^-118); byte 255 reads as float32 infinity, so a block with a NaN has values
      +-0, NaN where x is NaN or infinite (the sign of a NaN value byte is not specified).

    Dequantized: value * 2^(byte - 127) (``dequantize_mxfp8``).
    """
    blocks = _blocks(x, MX_BLOCK, "MXFP8")
    num_tokens, hidden = x.shape
    amax = blocks.abs().amax(dim=2)
    exponent = ((amax.view(torch.int32) >> 23) & 0xFF) - 127 - E4M3_EMAX
    biased = exponent.clamp(-E8M0_BIAS, E8M0_BIAS + 1) + E8M0_BIAS
    biased = torch.where(amax.isnan(), E8M0_NAN, biased)
    divisor = (biased << 23).view(torch.float32).clamp(min=F32_MIN_NORMAL)
    values = (blocks / divisor[:, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    scales = biased.to(torch.uint8).view(torch.float8_e8m0fnu)
    return values.reshape(num_tokens, hidden), scales


def dequantize_mxfp8(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 [T, H] from MXFP8 rows: values [T, H] float8_e4m3fn times 2^(byte - 127) of their
    scales [T, H / 32] float8_e8m0fnu (NaN for byte 255), as torchao's ``get_fp_scale``."""
    num_tokens, hidden = values.shape
    blocks = values.float().reshape(num_tokens, hidden // MX_BLOCK, MX_BLOCK)
    return (blocks * scales.float()[:, :, None]).reshape(num_tokens, hidden)


def _to_e2m1(v: torch.Tensor) -> torch.Tensor:
    """float32 ``v`` as e2m1 nibbles (uint8 0..15, 8 = sign): to nearest, ties to even,
    magnitudes past 6 saturate to 6. torchao's ``_f32_to_floatx_unpacked(v, 2, 1)``
    (prototype/custom_fp_utils.py) for values that are not NaN."""
    bits = v.view(torch.int32)
    sign = ((bits >> 28) & 0x8).to(torch.uint8)
    magnitude = (bits & 0x7FFFFFFF).view(torch.float32)
    # Below 1 (e2m1 subnormals, multiples of 0.5): add 2^22, whose float32 ulp is 0.5, so
    # that float32 addition rounds to even; 2 steps are 1.0, code 2.
    steps = ((magnitude + 2.0**22).view(torch.int32) - (149 << 23)).to(torch.uint8)
    # From 1: rebias the exponent (127 -> 1), round the 22 dropped bits to even, keep 3 bits.
    normal_bits = magnitude.view(torch.int32)
    odd = (normal_bits >> 22) & 1
    normal = ((normal_bits + ((1 - 127) << 23) + (2**21 - 1) + odd) >> 22).to(torch.uint8)
    code = torch.where(magnitude < 1.0, steps, normal)
    code = torch.where(magnitude >= E2M1_MAX, 7, code)
    return code | sign


def quantize_nvfp4(
    x: torch.Tensor, per_tensor_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 rows: ``x`` [T, H] bf16 / fp16 / fp32 (H % 16 == 0, else ValueError) as (values
    [T, H / 2] float4_e2m1fn_x2, scales [T, H / 16] float8_e4m3fn), one e4m3 scale per token
    and 16 consecutive channels, row-major; two e2m1 values a byte, the even channel in the low
    nibble (torchao's ``pack_uint4``).

    ``per_tensor_scale``: None, or a positive finite float32 scalar tensor s, the same for every
    row that will be multiplied together; rows that a dispatch brings together from several
    ranks must have been quantized with one s agreed by all of them (e.g. torchao's
    ``per_tensor_amax_to_scale`` of an all-reduced amax: amax / (448 * 6)).

    torchao's ``nvfp4_quantize(x, 16, per_tensor_scale)`` (prototype/mx_formats/
    nvfp4_tensor.py), computed in float32 with IEEE division and rounding:

    * amax: the block's largest magnitude; b = amax / 6;
    * without s: scale = e4m3(clamp(b, 2^-6, 448)) rounded to nearest, ties to even (so a
      block of zeros has scale 2^-6, not 0), and r = 1 / scale;
    * with s: scale = e4m3(clamp(b / s, 2^-6, 448)), r = (1 / s) / scale;
    * value = e2m1(clamp(x * r, -6, 6)), to nearest, ties to even.

    Infinite inputs saturate (the block's scale 448, the value +-6); NaN inputs give unspecified
    bits. Dequantized: value * (s * scale) (``dequantize_nvfp4``), as torchao's ``dequantize``.
    """
    blocks = _blocks(x, NVFP4_BLOCK, "NVFP4")
    num_tokens, hidden = x.shape
    amax = blocks.abs().amax(dim=2)
    block_scale = amax / torch.full_like(amax, E2M1_MAX)
    one = torch.ones_like(amax)
    if per_tensor_scale is None:
        scales = block_scale.clamp(E4M3_TINY, E4M3_MAX).to(torch.float8_e4m3fn)
        reciprocal = one / scales.float()
    else:
        s = _per_tensor_scale(per_tensor_scale, x.device)
        scales = (block_scale / s).clamp(E4M3_TINY, E4M3_MAX).to(torch.float8_e4m3fn)
        reciprocal = (one / s) / scales.float()
    codes = _to_e2m1((blocks * reciprocal[:, :, None]).clamp(-E2M1_MAX, E2M1_MAX))
    codes = codes.reshape(num_tokens, hidden // 2, 2)
    packed = codes[:, :, 0] | (codes[:, :, 1] << 4)
    return packed.view(torch.float4_e2m1fn_x2), scales


def _per_tensor_scale(scale: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``scale`` as a float32 scalar tensor on ``device``; ValueError unless it is one positive
    finite value."""
    if not isinstance(scale, torch.Tensor) or scale.numel() != 1:
        raise ValueError(f"per_tensor_scale must be a tensor of one value, got {scale!r}")
    s = scale.reshape(()).to(device=device, dtype=torch.float32)
    if not (0 < float(s) < float("inf")):
        raise ValueError(f"per_tensor_scale must be positive and finite, got {float(s)}")
    return s


def dequantize_nvfp4(
    values: torch.Tensor, scales: torch.Tensor, per_tensor_scale: torch.Tensor | None = None
) -> torch.Tensor:
    """float32 [T, H] from NVFP4 rows: the e2m1 values of ``values`` [T, H / 2]
    (float4_e2m1fn_x2 or uint8, even channel in the low nibble) times (per_tensor_scale *
    scale) of their scales [T, H / 16] float8_e4m3fn (per_tensor_scale None: 1)."""
    num_tokens, half = values.shape
    packed = values.view(torch.uint8)
    codes = torch.stack([packed & 0xF, packed >> 4], dim=2).reshape(num_tokens, 2 * half)
    table = torch.tensor(_E2M1_VALUES, device=values.device)
    data = torch.cat([table, -table])[codes.long()]
    block_scales = scales.float()
    if per_tensor_scale is not None:
        block_scales = per_tensor_scale.reshape(()).float().to(values.device) * block_scales
    blocks = data.reshape(num_tokens, -1, NVFP4_BLOCK) * block_scales[:, :, None]
    return blocks.reshape(num_tokens, 2 * half)


def to_blocked_scales(scales: torch.Tensor) -> torch.Tensor:
    """Row-major block scales [T, C] (one byte each: float8_e8m0fnu, float8_e4m3fn, uint8) in
    the tiled layout that cuBLAS / CUTLASS block-scaled GEMMs read ("128x4" swizzle, cuBLAS'
    "1D block scaling factors layout"), as torchao's ``to_blocked`` (prototype/mx_formats/
    utils.py) lays them out: [ceil(T / 128) * 128, ceil(C / 4) * 4] of the same dtype whose
    row-major bytes are the tiles of 128 rows and 4 columns in row-block-major order, the byte
    of (row r, column c) of a tile at (r % 32) * 16 + (r // 32) * 4 + c; padding bytes 0."""
    rows, cols = scales.shape
    row_blocks, col_blocks = -(-rows // 128), -(-cols // 4)
    padded = torch.zeros(row_blocks * 128, col_blocks * 4, dtype=torch.uint8, device=scales.device)
    padded[:rows, :cols] = scales.view(torch.uint8)
    tiles = padded.view(row_blocks, 128, col_blocks, 4).permute(0, 2, 1, 3)
    blocked = tiles.reshape(-1, 4, 32, 4).transpose(1, 2).reshape(row_blocks * 128, col_blocks * 4)
    return blocked.view(scales.dtype)


# The quantizer of each block-scaled format a dispatch moves (Buffer.dispatch's quantize=;
# NVFP4 without a per-tensor scale, as there).
QUANTIZERS = {"fp8": quantize_fp8, "mxfp8": quantize_mxfp8, "nvfp4": quantize_nvfp4}
DEQUANTIZERS = {"fp8": dequantize_fp8, "mxfp8": dequantize_mxfp8, "nvfp4": dequantize_nvfp4}


# -- Low-latency mode (DeepEP V1's low_latency_dispatch / low_latency_combine) ---------------
#
# Not collective: these functions take every rank's inputs (lists indexed by rank, which a test
# can draw on every rank from shared seeds) and compute what one rank receives. Layout, with
# W = len(xs) ranks, L = num_experts / W local experts a rank and M' = max_tokens:
#
# * the rows of local expert e of rank r are the (source rank j, token t) pairs whose top-k ids
#   name r's global expert r * L + e: first r's own tokens, then the other ranks' in ascending
#   rank order, each source's in ascending token order;
# * recv_x [L, W * M', H] holds them from row 0 of each expert, recv_count [L] int32 how many;
# * src_info [L, W * M'] int32 is each row's source token index t, layout_range [L, W] int64
#   (first row of source j's run << 32) | its rows, token_slots [T, K] int32 the position of
#   each (t, k) among this rank's tokens that name slot k's expert (token order).

LL_AMAX_FLOOR = 1e-4  # DeepEP's floor on a group's amax in its low-latency cast (as float32)


@dataclass
class LowLatencyDispatch:
    """What one rank receives from :func:`low_latency_dispatch` (rows past ``recv_count`` are
    zero, and -1 in ``src_info`` / ``source_rank``; they are not specified for the library).

    Attributes:
        recv_x: ``[L, W * M', H]`` the rows in x's dtype (also with FP8, unquantized).
        recv_count: ``[L]`` int32, rows of each local expert.
        src_info: ``[L, W * M']`` int32, each row's source token index.
        source_rank: ``[L, W * M']`` int32, each row's source rank.
        layout_range: ``[L, W]`` int64, ``(first row << 32) | rows`` of each (expert, source).
        token_slots: ``[T, K]`` int32 of this rank's tokens: for a valid slot (t, k), the
            position of t among this rank's tokens that name expert ``topk_idx[t, k]``; -1 for
            unused slots.
        values: with FP8, ``[L, W * M', H]`` float8_e4m3fn (zeros past the counts); else None.
        scales: with FP8, ``[L, W * M', H / 128]`` float32 (power-of-two with round_scale), or
            with UE8M0 ``[L, W * M', ceil(H / 512)]`` int32 of four exponent bytes (group
            4p + i in byte i, little-endian; bytes past the last group 0); both with the rows
            fastest (strides ``(C * W * M', 1, W * M')``), as DeepEP lays them out. Else None.
    """

    recv_x: torch.Tensor
    recv_count: torch.Tensor
    src_info: torch.Tensor
    source_rank: torch.Tensor
    layout_range: torch.Tensor
    token_slots: torch.Tensor
    values: torch.Tensor | None = None
    scales: torch.Tensor | None = None


def _low_latency_rows(topk_idxs: list, num_experts: int, rank: int):
    """(rows, layout_range) of ``rank``: rows[e] the (source rank, token) pairs of local expert
    e in receive order; layout_range [L, W] int64 as :class:`LowLatencyDispatch`'s."""
    world = len(topk_idxs)
    if num_experts < world or num_experts % world:
        raise ValueError(f"num_experts={num_experts} is not a positive multiple of {world} ranks")
    local = num_experts // world
    sources = [rank] + [j for j in range(world) if j != rank]  # own tokens first
    rows: list[list[tuple[int, int]]] = [[] for _ in range(local)]
    layout_range = torch.zeros(local, world, dtype=torch.int64)
    for e in range(local):
        expert = rank * local + e
        for j in sources:
            idx = topk_idxs[j].cpu().long()
            tokens = (idx == expert).any(dim=1).nonzero().flatten().tolist()
            layout_range[e, j] = (len(rows[e]) << 32) | len(tokens)
            rows[e].extend((j, t) for t in tokens)
    return rows, layout_range


def low_latency_token_slots(topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``[T, K]`` int32: for each valid slot (t, k), how many of the tokens before t name
    expert ``topk_idx[t, k]`` (t's position in the list of this rank's tokens of that expert);
    -1 for unused slots."""
    idx = topk_idx.cpu().long()
    valid = idx >= 0
    names = torch.zeros(idx.shape[0], num_experts, dtype=torch.int64)  # [T, E] 0/1
    # Unused slots add 0 (at column 0); ids are distinct within a row, so names is 0 / 1.
    names.scatter_add_(1, idx.clamp(min=0), valid.long())
    before = names.cumsum(0) - names  # tokens before t naming each expert
    slots = before.gather(1, idx.clamp(min=0))
    return torch.where(valid, slots, -1).to(torch.int32)


def quantize_fp8_low_latency(
    x: torch.Tensor, round_scale: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepEP's low-latency FP8 cast of rows ``x`` [T, H] (H % 128 == 0): (values [T, H]
    float8_e4m3fn, scales [T, H / 128] float32), one scale per token and 128 channels.

    amax is the group's largest magnitude in float32 and a = max(amax, float32(1e-4)).
    Without ``round_scale``: scale = a * float32(1 / 448) (a product, not a quotient) and
    factor = 448 / a (IEEE float32 division). With ``round_scale``: scale = 2^e with
    e = ceil(log2(a * float32(1 / 448))), exactly from the float32 bits (exponent - 127, plus 1
    if any mantissa bit is set), and factor = 2^-e. value = x * factor rounded to the nearest
    e4m3 value (ties to even), saturated at +-448. The scale's UE8M0 byte (``use_ue8m0``) is
    its exponent field, e + 127 (:func:`ue8m0_bytes`).
    """
    num_tokens, hidden = x.shape
    if hidden % FP8_GROUP:
        raise ValueError(f"FP8 rows need a hidden size that is a multiple of 128, got {hidden}")
    blocks = x.float().reshape(num_tokens, hidden // FP8_GROUP, FP8_GROUP)
    amax = blocks.abs().amax(dim=2)
    a = torch.maximum(amax, torch.full_like(amax, LL_AMAX_FLOOR))  # float32(1e-4)
    scale = a * torch.full_like(a, 1.0 / E4M3_MAX)  # float32(1/448), a float32 product
    if round_scale:
        bits = scale.view(torch.int32)
        exponent = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)
        scale = ((exponent + 127) << 23).view(torch.float32)  # 2^e, exact
        factor = ((127 - exponent) << 23).view(torch.float32)  # 2^-e, exact
    else:
        factor = torch.full_like(a, E4M3_MAX) / a  # tensor / tensor: the IEEE quotient
    ratio = blocks * factor[:, :, None]
    values = ratio.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return values.reshape(num_tokens, hidden), scale


def ue8m0_bytes(scales: torch.Tensor) -> torch.Tensor:
    """Power-of-two float32 scales [..., G] as int32 [..., ceil(G / 4)] words whose byte i
    (little-endian) is the UE8M0 byte (float32 exponent field) of group 4p + i; 0 past G."""
    exponents = (scales.view(torch.int32) >> 23) & 0xFF
    groups = scales.shape[-1]
    pad = -groups % 4
    exponents = torch.nn.functional.pad(exponents, (0, pad))
    quads = exponents.reshape(*exponents.shape[:-1], -1, 4).long()
    words = quads[..., 0] | quads[..., 1] << 8 | quads[..., 2] << 16 | quads[..., 3] << 24
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # same bits


def _rows_fastest(per_row: torch.Tensor) -> torch.Tensor:
    """[L, N, C] with DeepEP's scale strides (C * N, 1, N): the same values, rows fastest."""
    num_local, rows, cols = per_row.shape
    out = per_row.new_zeros(num_local, cols, rows).transpose(1, 2)
    out.copy_(per_row)
    return out


def low_latency_dispatch(
    xs: list,
    topk_idxs: list,
    num_experts: int,
    max_tokens: int,
    rank: int,
    use_fp8: bool = False,
    round_scale: bool = False,
    use_ue8m0: bool = False,
) -> LowLatencyDispatch:
    """What rank ``rank`` receives from a low-latency dispatch (on the CPU).

    Args:
        xs: every rank's tokens ``[T_j, H]`` (T_j <= max_tokens), indexed by rank.
        topk_idxs: every rank's ``[T_j, K]`` int32 / int64 global expert ids, -1 unused, ids
            distinct within a row.
        num_experts: E, a multiple of W = len(xs).
        max_tokens: M' (num_max_dispatch_tokens_per_rank): rows per local expert W * M'.
        rank: the receiving rank.
        use_fp8, round_scale, use_ue8m0: as ``Buffer.low_latency_dispatch``'s; FP8 values and
            scales are those of :func:`quantize_fp8_low_latency` of each source row.
    """
    world = len(xs)
    if len(topk_idxs) != world:
        raise ValueError(f"{len(xs)} xs but {len(topk_idxs)} topk_idxs")
    if use_ue8m0 and not (use_fp8 and round_scale):
        raise ValueError("use_ue8m0 needs use_fp8 and round_scale")
    xs = [x.cpu() for x in xs]
    for j, (x, idx) in enumerate(zip(xs, topk_idxs, strict=True)):
        if x.shape[0] > max_tokens or idx.shape[0] != x.shape[0]:
            raise ValueError(
                f"rank {j}: x {tuple(x.shape)}, topk_idx {tuple(idx.shape)}, "
                f"max_tokens {max_tokens}"
            )
    hidden = xs[rank].shape[1]
    rows, layout_range = _low_latency_rows(topk_idxs, num_experts, rank)
    local, capacity = len(rows), world * max_tokens
    recv_x = torch.zeros(local, capacity, hidden, dtype=xs[rank].dtype)
    src_info = torch.full((local, capacity), -1, dtype=torch.int32)
    source_rank = torch.full((local, capacity), -1, dtype=torch.int32)
    for e, pairs in enumerate(rows):
        for n, (j, t) in enumerate(pairs):
            recv_x[e, n] = xs[j][t]
            src_info[e, n], source_rank[e, n] = t, j
    recv_count = torch.tensor([len(pairs) for pairs in rows], dtype=torch.int32)
    result = LowLatencyDispatch(
        recv_x=recv_x,
        recv_count=recv_count,
        src_info=src_info,
        source_rank=source_rank,
        layout_range=layout_range,
        token_slots=low_latency_token_slots(topk_idxs[rank], num_experts),
    )
    if use_fp8:
        values, scales = quantize_fp8_low_latency(recv_x.reshape(-1, hidden), round_scale)
        valid = torch.arange(capacity)[None, :] < recv_count[:, None].long()  # [L, W * M']
        values = values.reshape(local, capacity, hidden)
        values.view(torch.uint8)[~valid] = 0
        scales = scales.reshape(local, capacity, -1)
        scales = ue8m0_bytes(scales) if use_ue8m0 else scales
        scales[~valid] = 0
        result.values, result.scales = values, _rows_fastest(scales)
    return result


def low_latency_combine(
    ys: list,
    topk_idxs: list,
    topk_weights: torch.Tensor,
    num_experts: int,
    rank: int,
) -> torch.Tensor:
    """What rank ``rank``'s low-latency combine returns (on the CPU): ``[T, H]`` of ``ys``'
    dtype, out[t] = sum over t's valid slots k (in slot order) of ``topk_weights[t, k]`` times
    the row of (``rank``, t) among the rows of expert ``topk_idx[t, k]`` on its owner, in
    float32, then rounded; zeros for a token without a valid slot.

    Args:
        ys: every rank's expert outputs ``[L, W * M', H]`` in its recv_x's row layout (as
            :func:`low_latency_dispatch` lays it out), indexed by rank.
        topk_idxs: every rank's topk_idx of the dispatch (the layout depends on all of them).
        topk_weights: ``[T, K]`` float32 weights of rank ``rank``'s tokens.
        num_experts: E; rank ``rank``'s tokens are topk_idxs[rank]'s rows.
    """
    world = len(ys)
    local = num_experts // world
    idx = topk_idxs[rank].cpu().long()
    weights = topk_weights.cpu().float()
    num_tokens, topk = idx.shape
    hidden = ys[rank].shape[-1]
    slots = low_latency_token_slots(idx, num_experts)
    # First row of this rank's run in every global expert's rows on its owner.
    first = torch.zeros(num_experts, dtype=torch.int64)
    for owner in range(world):
        _, layout_range = _low_latency_rows(topk_idxs, num_experts, owner)
        first[owner * local : (owner + 1) * local] = layout_range[:, rank] >> 32
    out = torch.zeros(num_tokens, hidden, dtype=torch.float32)
    for t in range(num_tokens):
        for k in range(topk):
            expert = int(idx[t, k])
            if expert < 0:
                continue
            owner, e = divmod(expert, local)
            row = int(first[expert]) + int(slots[t, k])
            out[t] += weights[t, k] * ys[owner][e, row].cpu().float()
    return out.to(ys[rank].dtype)
