"""Combine launches: the local reduction, the transfer (one persistent kernel on the Buffer's SM
budget) and the local sum per token."""

import torch
import triton

from .._planner import MAX_PROGRAMS
from ..kernels.combine import reduce_kernel, return_kernel, sum_kernel
from . import Runtime, local_slices
from .dispatch import DispatchHandle


def reduce_tokens(
    rt: Runtime, y: torch.Tensor, handle: DispatchHandle, weights: torch.Tensor | None
) -> torch.Tensor:
    """Sum ``y`` [N, H] (times ``weights`` [N] float32) back into out [T, H]; collective."""
    plan, cfg, heap = rt.plan, rt.plan.config, rt.plan.heap
    world, rank, num_tokens = rt.world_size, rt.rank, handle.num_tokens
    out = torch.empty(num_tokens, plan.hidden, dtype=y.dtype, device=rt.device)
    has_weights = weights is not None
    slices = local_slices(rt)
    reduce_kernel[(rt.local_programs,)](
        y, y.stride(0), weights.contiguous() if has_weights else y, rt.outbox, plan.hidden, rank,
        slices, handle.recv_chunk_start, handle.recv_src_tokens, handle.staged_rows,
        rt.heap.peer_bases, heap.staging,
        W=world, T_MAX=plan.max_tokens, NC_MAX=plan.max_chunks, MS=plan.meta_stride,
        MS_P2=triton.next_power_of_2(plan.meta_stride), CHUNK=cfg.chunk_tokens,
        BLOCK_H=cfg.combine_block_h, HAS_WEIGHTS=has_weights, COPY_UNROLL=cfg.copy_unroll,
        num_warps=rt.local_warps,
    )  # fmt: skip
    return_kernel[(cfg.num_programs,)](
        rt.outbox, num_tokens, plan.hidden, world, rank, handle.recv_chunk_start,
        handle.recv_src_tokens, rt.heap.peer_bases, heap.combine_ready, heap.chunk_flags,
        heap.staging, rt.control, rt.timeout_ns,
        T_MAX=plan.max_tokens, NC_MAX=plan.max_chunks, H_SLICES=cfg.h_slices, P_MAX=MAX_PROGRAMS,
        CHUNK=cfg.chunk_tokens, BLOCK_H=cfg.block_h, num_warps=cfg.num_warps,
    )  # fmt: skip
    sum_kernel[(rt.local_programs,)](
        out, num_tokens, plan.hidden, world, rank, slices, handle.token_rank_pos,
        handle.send_chunk_start, rt.heap.peer_bases, heap.staging,
        T_MAX=plan.max_tokens, W_P2=triton.next_power_of_2(world), CHUNK=cfg.chunk_tokens,
        BLOCK_H=cfg.combine_block_h, num_warps=rt.local_warps,
    )  # fmt: skip
    return out
