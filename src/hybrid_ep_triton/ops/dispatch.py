"""Dispatch launches: the layout (two kernels) and the data move (one persistent kernel)."""

import math
from dataclasses import dataclass

import torch
import triton

from .._planner import MAX_PROGRAMS
from ..kernels.dispatch import dispatch_kernel
from ..kernels.route import count_chunk_kernel, exchange_layout_kernel
from . import Runtime

# Experts per tile in the counting kernel: bounds its [CHUNK, K, E_BLOCK] comparison tile.
_E_BLOCK = 32
# Chunks per tile in the exchange kernel.
_C_BLOCK = 64


@dataclass
class DispatchHandle:
    """Everything combine and a cached dispatch need; produced by ``Buffer.dispatch``.

    Sender side (this rank's tokens):
        topk_idx [T, K] int32, slot_pos [T, K] int32, token_rank_pos [T, W] int32,
        send_chunk_start [NC_MAX + 1, W] int32, chunk_expert_base [NC_MAX, E] int32.
    Receiver side (rows that came to this rank):
        recv_chunk_start [W, NC_MAX + 1] int32, recv_src_tokens [W] int32,
        expert_layout [3, L] int32 (segment start, valid rows, padded rows),
        tokens_per_expert [L] int64, staged_rows [W, T_MAX, MS] int32 (filled by the data move).
    info: int64 [4] on the device: [0] rows the expert-major layout needs (padding included, even
        past max_recv_tokens), [1] first rank whose topk_idx was invalid or -1, [2] first invalid
        row of this rank's topk_idx (or a large value).
    num_recv_rows: N, the rows of recv_x.
    """

    num_tokens: int
    topk: int
    num_recv_rows: int
    max_recv_tokens: int | None
    topk_idx: torch.Tensor
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


def compute_layout(
    rt: Runtime, topk_idx: torch.Tensor, pad_multiple: int, max_recv_tokens: int | None
) -> DispatchHandle:
    """Launch the counting and exchange kernels for ``topk_idx`` [T, K]; collective.

    With ``max_recv_tokens`` the handle's ``num_recv_rows`` is set to it; without, it is left
    at -1 for the caller to set once it has read the row count.
    """
    plan, dev = rt.plan, rt.device
    num_tokens, topk = topk_idx.shape
    chunk = plan.config.chunk_tokens
    num_chunks = triton.cdiv(num_tokens, chunk)
    world, experts, local = rt.world_size, plan.num_experts, plan.experts_per_rank
    topk_idx = topk_idx.contiguous()
    # One int32 and one int64 allocation for the whole handle and the counting scratch: a
    # dispatch is latency-bound at small batches, and every allocator call costs host time.
    shapes = {
        "slot_pos": (num_tokens, topk),
        "token_rank_pos": (num_tokens, world),
        "chunk_expert_count": (num_chunks, experts),
        "chunk_rank_count": (num_chunks, world),
        "send_chunk_start": (plan.max_chunks + 1, world),
        "chunk_expert_base": (num_chunks, experts),
        "recv_chunk_start": (world, plan.max_chunks + 1),
        "recv_src_tokens": (world,),
        "expert_layout": (3, local),
        "staged_rows": (world, plan.max_tokens, plan.meta_stride),
    }
    # Each part starts on a 16-byte boundary, as Triton's pointer specialisation expects.
    sizes = [triton.cdiv(math.prod(shape), 4) * 4 for shape in shapes.values()]
    flat = torch.empty(sum(sizes), dtype=torch.int32, device=dev).split(sizes)
    t = {
        name: part[: math.prod(shape)].view(shape)
        for (name, shape), part in zip(shapes.items(), flat, strict=True)
    }
    info, tokens_per_expert = torch.empty(4 + local, dtype=torch.int64, device=dev).split(
        [4, local]
    )
    info.fill_(2**62)
    if num_chunks:
        count_chunk_kernel[(num_chunks,)](
            topk_idx, num_tokens, topk, experts, local, world,
            t["slot_pos"], t["token_rank_pos"], t["chunk_expert_count"], t["chunk_rank_count"],
            info[2:],
            CHUNK=chunk, K_P2=triton.next_power_of_2(topk),
            W_P2=triton.next_power_of_2(world), E_BLOCK=_E_BLOCK,
        )  # fmt: skip
    handle = DispatchHandle(
        num_tokens=num_tokens,
        topk=topk,
        num_recv_rows=-1 if max_recv_tokens is None else max_recv_tokens,
        max_recv_tokens=max_recv_tokens,
        topk_idx=topk_idx,
        slot_pos=t["slot_pos"],
        token_rank_pos=t["token_rank_pos"],
        send_chunk_start=t["send_chunk_start"],
        chunk_expert_base=t["chunk_expert_base"],
        recv_chunk_start=t["recv_chunk_start"],
        recv_src_tokens=t["recv_src_tokens"],
        expert_layout=t["expert_layout"],
        tokens_per_expert=tokens_per_expert,
        staged_rows=t["staged_rows"],
        info=info,
    )
    exchange_layout_kernel[(1,)](
        rt.heap.peer_bases, rt.rank, world, num_tokens, num_chunks, experts, local, pad_multiple,
        2**31 - 1 if max_recv_tokens is None else max_recv_tokens,
        t["chunk_expert_count"], t["chunk_rank_count"], info[2:], handle.chunk_expert_base,
        handle.send_chunk_start, handle.recv_chunk_start,
        handle.recv_src_tokens, handle.expert_layout, handle.tokens_per_expert, info, rt.control,
        plan.heap.count_flags, plan.heap.counts, plan.heap.chunk_table, rt.timeout_ns,
        NC_MAX=plan.max_chunks, ROW=plan.counts_row, C_BLOCK=_C_BLOCK, E_BLOCK=_E_BLOCK,
        W_P2=triton.next_power_of_2(world), L_P2=triton.next_power_of_2(local),
    )  # fmt: skip
    return handle


def move_tokens(
    rt: Runtime,
    x: torch.Tensor,
    topk_weights: torch.Tensor | None,
    handle: DispatchHandle,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launch the data move for ``x`` [T, H] along ``handle``; collective.

    Returns recv_x [N, H] (x's dtype) and recv_weights [N] float32 (None without topk_weights).
    """
    plan, cfg = rt.plan, rt.plan.config
    num_rows = handle.num_recv_rows
    recv_x = torch.empty(num_rows, plan.hidden, dtype=x.dtype, device=rt.device)
    has_weights = topk_weights is not None
    recv_weights = torch.empty(
        num_rows if has_weights else 0, dtype=torch.float32, device=rt.device
    )
    weights_arg = topk_weights.contiguous() if has_weights else recv_weights
    dispatch_kernel[(cfg.num_programs,)](
        x, x.stride(0), handle.topk_idx, weights_arg, handle.num_tokens, handle.topk, plan.hidden,
        plan.num_experts, plan.experts_per_rank, rt.world_size, rt.rank, num_rows,
        handle.slot_pos, handle.token_rank_pos, handle.send_chunk_start, handle.chunk_expert_base,
        handle.recv_chunk_start, handle.recv_src_tokens, handle.expert_layout, handle.info,
        handle.staged_rows, recv_x, recv_weights,
        rt.heap.peer_bases, plan.heap.dispatch_ready, plan.heap.chunk_flags, plan.heap.meta_rows,
        plan.heap.meta_weights, plan.heap.staging, rt.control, rt.timeout_ns,
        T_MAX=plan.max_tokens, NC_MAX=plan.max_chunks, H_SLICES=cfg.h_slices, P_MAX=MAX_PROGRAMS,
        MS=plan.meta_stride, MS_P2=triton.next_power_of_2(plan.meta_stride),
        K_P2=triton.next_power_of_2(handle.topk), W_P2=triton.next_power_of_2(rt.world_size),
        CHUNK=cfg.chunk_tokens, BLOCK_H=cfg.block_h,
        HAS_WEIGHTS=has_weights, num_warps=cfg.num_warps,
    )  # fmt: skip
    return recv_x, (recv_weights if has_weights else None)
