"""Dispatch launches: the layout (one kernel), then the data move (one kernel whose first
programs, the senders, push rows to the other ranks and whose others, on the rest of the GPU,
expand into expert-major rows)."""

import functools
import math
from dataclasses import dataclass

import torch

from .._planner import MAX_PROGRAMS, MAX_REGISTERS, Plan, ceil_div, next_power_of_2
from ..kernels.dispatch import dispatch_kernel
from ..kernels.route import layout_kernel
from . import Runtime, local_parts, programs_beside_senders

# Slots per side of the layout kernel's [PAIRS, PAIRS] tiles of slot pairs.
_PAIRS = 128
# Most elements of one tile of the layout exchange's prefix sums: each tile is a round trip to
# memory, in a single program.
_EXCHANGE_TILE = 8192


@dataclass
class DispatchHandle:
    """Everything combine and a cached dispatch need; produced by ``Buffer.dispatch``.

    The int32 parts are views of one tensor, ``ints``, and the int64 parts of ``longs``, so that
    the torch.library operators pass a handle as a few tensors (``make_handle`` rebuilds it).
    Sender side (this rank's tokens):
        topk_idx [T, K] int32 or int64, slot_pos [T, K] int32, token_rank_pos [T, W] int32,
        send_chunk_start [NC_MAX + 1, W] int32, chunk_expert_base [NC + 1, E] int32 (row 0:
        destination row of each expert's first slot from this rank; row c + 1: offset of chunk
        c's first slot among them).
    Receiver side (rows that came to this rank):
        recv_chunk_start [W, NC_MAX + 1] int32, recv_src_tokens [W] int32,
        expert_layout [3, L] int32 (segment start, valid rows, padded rows),
        tokens_per_expert [L] int64, staged_rows [W, T_MAX, MS] int32 (filled by the data move),
        recv_topk_idx [N, K] int32 with token rows (filled by the data move; None otherwise).
    info: int64 [4] on the device: [0] rows the output needs (expert-major: padding included;
        token rows: the tokens received; even past max_recv_tokens), [1] first rank whose
        topk_idx was invalid or -1, [2] first invalid row of this rank's topk_idx (or a large
        value).
    num_recv_rows: N, the rows of recv_x.
    """

    num_tokens: int
    topk: int
    num_recv_rows: int
    max_recv_tokens: int | None
    topk_idx: torch.Tensor
    ints: torch.Tensor
    longs: torch.Tensor
    slot_pos: torch.Tensor
    token_rank_pos: torch.Tensor
    send_chunk_start: torch.Tensor
    chunk_expert_base: torch.Tensor
    recv_chunk_start: torch.Tensor
    recv_src_tokens: torch.Tensor
    expert_layout: torch.Tensor
    tokens_per_expert: torch.Tensor
    staged_rows: torch.Tensor
    info: torch.Tensor
    recv_topk_idx: torch.Tensor | None = None


def _int_parts(plan: Plan, num_tokens: int, topk: int) -> dict[str, tuple[int, ...]]:
    """Shapes of the int32 parts of a handle, in ``ints`` order."""
    world, experts = plan.world_size, plan.num_experts
    num_chunks = ceil_div(num_tokens, plan.config.chunk_tokens)
    return {
        "slot_pos": (num_tokens, topk),
        "token_rank_pos": (num_tokens, world),
        "send_chunk_start": (plan.max_chunks + 1, world),
        "chunk_expert_base": (num_chunks + 1, experts),
        "recv_chunk_start": (world, plan.max_chunks + 1),
        "recv_src_tokens": (world,),
        "expert_layout": (3, plan.experts_per_rank),
        "staged_rows": (world, plan.max_tokens, plan.meta_stride),
    }


@functools.lru_cache(maxsize=256)
def _int_layout(plan: Plan, num_tokens: int, topk: int) -> tuple[int, tuple]:
    """(int32 elements of ``ints``, its parts as (name, shape, strides, offset)). Each part
    starts on a 16-byte boundary, as Triton's pointer specialisation expects. Cached: every call
    needs it, and a dispatch is latency-bound at small batches."""
    parts, offset = [], 0
    for name, shape in _int_parts(plan, num_tokens, topk).items():
        strides = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
        parts.append((name, shape, strides, offset))
        offset += ceil_div(math.prod(shape), 4) * 4
    return offset, tuple(parts)


def handle_sizes(plan: Plan, num_tokens: int, topk: int) -> tuple[int, int]:
    """Elements of a handle's ``ints`` (int32) and ``longs`` (int64) tensors."""
    return _int_layout(plan, num_tokens, topk)[0], 4 + plan.experts_per_rank


def _int_views(plan: Plan, num_tokens: int, topk: int, ints: torch.Tensor) -> dict:
    # Offsets into ints' storage: ints is always an allocation of its own (storage offset 0).
    return {
        name: ints.as_strided(shape, strides, offset)
        for name, shape, strides, offset in _int_layout(plan, num_tokens, topk)[1]
    }


def make_handle(
    plan: Plan,
    topk_idx: torch.Tensor,
    ints: torch.Tensor,
    longs: torch.Tensor,
    num_recv_rows: int,
    max_recv_tokens: int | None,
) -> DispatchHandle:
    """The handle whose parts are views of ``ints`` and ``longs`` (see handle_sizes)."""
    parts = _int_views(plan, *topk_idx.shape, ints)
    return _handle_from_parts(plan, topk_idx, parts, ints, longs, num_recv_rows, max_recv_tokens)


def _handle_from_parts(
    plan: Plan,
    topk_idx: torch.Tensor,
    parts: dict,
    ints: torch.Tensor,
    longs: torch.Tensor,
    num_recv_rows: int,
    max_recv_tokens: int | None,
) -> DispatchHandle:
    num_tokens, topk = topk_idx.shape
    info, tokens_per_expert = longs.split([4, plan.experts_per_rank])
    return DispatchHandle(
        num_tokens=num_tokens,
        topk=topk,
        num_recv_rows=num_recv_rows,
        max_recv_tokens=max_recv_tokens,
        topk_idx=topk_idx,
        ints=ints,
        longs=longs,
        slot_pos=parts["slot_pos"],
        token_rank_pos=parts["token_rank_pos"],
        send_chunk_start=parts["send_chunk_start"],
        chunk_expert_base=parts["chunk_expert_base"],
        recv_chunk_start=parts["recv_chunk_start"],
        recv_src_tokens=parts["recv_src_tokens"],
        expert_layout=parts["expert_layout"],
        tokens_per_expert=tokens_per_expert,
        staged_rows=parts["staged_rows"],
        info=info,
    )


def compute_layout(
    rt: Runtime, topk_idx: torch.Tensor, pad_multiple: int, max_recv_tokens: int | None
) -> DispatchHandle:
    """Launch the layout kernel for ``topk_idx`` [T, K] (contiguous); collective.

    With ``max_recv_tokens`` the handle's ``num_recv_rows`` is set to it; without, it is left
    at -1 for the caller to set once it has read the row count.
    """
    plan, dev = rt.plan, rt.device
    num_tokens, topk = topk_idx.shape
    num_chunks = ceil_div(num_tokens, plan.config.chunk_tokens)
    world, experts = rt.world_size, plan.num_experts
    # One int32 and one int64 allocation for the whole handle: a dispatch is latency-bound at
    # small batches, and every allocator call costs host time.
    num_ints, num_longs = handle_sizes(plan, num_tokens, topk)
    ints = torch.empty(num_ints, dtype=torch.int32, device=dev)
    handle = _handle_from_parts(
        plan,
        topk_idx,
        _int_views(plan, num_tokens, topk, ints),
        ints,
        torch.empty(num_longs, dtype=torch.int64, device=dev),
        -1 if max_recv_tokens is None else max_recv_tokens,
        max_recv_tokens,
    )
    e_p2, w_p2 = next_power_of_2(experts), next_power_of_2(world)
    layout_kernel[(max(num_chunks, 1),)](
        topk_idx, num_tokens, num_chunks, topk, experts, plan.experts_per_rank, rt.rank, world,
        pad_multiple, 2**31 - 1 if max_recv_tokens is None else max_recv_tokens,
        handle.slot_pos, handle.token_rank_pos, handle.chunk_expert_base,
        handle.send_chunk_start, handle.recv_chunk_start, handle.recv_src_tokens,
        handle.expert_layout, handle.tokens_per_expert, handle.info, rt.heap.peer_bases,
        rt.control, plan.heap.count_flags, plan.heap.counts, plan.heap.chunk_table,
        rt.timeout_ns,
        CHUNK=plan.config.chunk_tokens, K_P2=next_power_of_2(topk), W_P2=w_p2, E_P2=e_p2,
        L_P2=next_power_of_2(plan.experts_per_rank),
        PAIRS=min(plan.config.chunk_tokens * next_power_of_2(topk), _PAIRS),
        NC_MAX=plan.max_chunks, ROW=plan.counts_row,
        C_BLOCK=max(1, _EXCHANGE_TILE // e_p2),
        TABLE_BLOCK=min(next_power_of_2(plan.max_chunks + 1), _EXCHANGE_TILE // w_p2),
        TOKEN_ROWS=plan.token_rows,
    )  # fmt: skip
    return handle


def _own_slices(rt: Runtime, expanders: int) -> int:
    """Column slices of an own chunk in the expansion: about two work items per expander at
    max_tokens, at most one tile column per slice."""
    plan = rt.plan
    tiles = ceil_div(plan.hidden, plan.config.block_h)
    return max(1, min(tiles, ceil_div(2 * expanders, plan.max_chunks)))


def move_tokens(
    rt: Runtime,
    x: torch.Tensor,
    topk_weights: torch.Tensor | None,
    handle: DispatchHandle,
    cached: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launch the data move for ``x`` [T, H] along ``handle``; collective. ``cached``: the
    handle's staged_rows (and recv_topk_idx) were filled by an earlier move and stay as they
    are; otherwise a token-row plan's move sets handle.recv_topk_idx.

    Returns recv_x [N, H] (x's dtype) and recv_weights (None without topk_weights): [N] float32,
    with token rows [N, K].
    """
    plan, cfg = rt.plan, rt.plan.config
    topk_idx, num_tokens, topk = handle.topk_idx, handle.num_tokens, handle.topk
    num_rows = handle.num_recv_rows
    recv_x = torch.empty(num_rows, plan.hidden, dtype=x.dtype, device=rt.device)
    has_weights = topk_weights is not None
    weights_shape = (num_rows, topk) if plan.token_rows else (num_rows,)
    recv_weights = torch.empty(
        weights_shape if has_weights else 0, dtype=torch.float32, device=rt.device
    )
    recv_topk_idx = recv_weights  # unused unless a token-row move writes it
    if plan.token_rows and not cached:
        recv_topk_idx = torch.empty(num_rows, topk, dtype=torch.int32, device=rt.device)
        handle.recv_topk_idx = recv_topk_idx
    weights_arg = topk_weights.contiguous() if has_weights else recv_weights
    world, rank, heap = rt.world_size, rt.rank, plan.heap
    expanders = programs_beside_senders(rt)
    dispatch_kernel[(cfg.senders + expanders,)](
        x, x.stride(0), topk_idx, weights_arg, num_tokens, topk, plan.hidden, plan.num_experts,
        plan.experts_per_rank, rank, num_rows, cfg.senders, _own_slices(rt, expanders),
        local_parts(plan, cfg.block_h),
        handle.slot_pos, handle.token_rank_pos, handle.send_chunk_start, handle.chunk_expert_base,
        handle.recv_chunk_start, handle.recv_src_tokens, handle.expert_layout, handle.info,
        handle.staged_rows, recv_x, recv_weights, recv_topk_idx, rt.heap.peer_bases,
        heap.dispatch_ready,
        heap.chunk_flags, heap.meta_rows, heap.meta_weights, heap.staging, rt.control,
        rt.timeout_ns,
        W=world, T_MAX=plan.max_tokens, NC_MAX=plan.max_chunks, H_SLICES=cfg.h_slices,
        P_MAX=MAX_PROGRAMS, MS=plan.meta_stride, MS_P2=next_power_of_2(plan.meta_stride),
        K_P2=next_power_of_2(topk), W_P2=next_power_of_2(world),
        CHUNK=cfg.chunk_tokens, BLOCK_H=cfg.block_h, HAS_WEIGHTS=has_weights,
        WRITE_ROWS=not cached, TOKEN_ROWS=plan.token_rows, STAGES=cfg.copy_stages,
        num_warps=cfg.num_warps,
        maxnreg=MAX_REGISTERS,
    )  # fmt: skip
    return recv_x, (recv_weights if has_weights else None)
