"""Combine launch: one kernel whose reducers and finishers (the rest of the GPU) surround the
sending programs."""

import torch

from .._planner import LOCAL_PARTS, MAX_PROGRAMS, MAX_REGISTERS, next_power_of_2
from ..kernels.combine import combine_kernel
from . import Runtime, local_parts, programs_beside_senders
from .dispatch import DispatchHandle


def _reducers(local: int, world: int) -> int:
    """Local programs that reduce the other ranks' rows: those rows are (W - 1) / W of the
    expert rows a rank gathers, and the finishers gather the rest, then add the partial rows."""
    return min(max(round(local * (world - 1) / world), 1), local - 1)


def reduce_tokens(
    rt: Runtime, y: torch.Tensor, handle: DispatchHandle, weights: torch.Tensor | None
) -> torch.Tensor:
    """Sum ``y`` [N, H] (times ``weights`` [N] float32) back into out [T, H]; collective."""
    plan, cfg, heap = rt.plan, rt.plan.config, rt.plan.heap
    out = torch.empty(handle.num_tokens, plan.hidden, dtype=y.dtype, device=rt.device)
    has_weights = weights is not None
    local = programs_beside_senders(rt)
    reducers = _reducers(local, rt.world_size)
    combine_kernel[(cfg.senders + local,)](
        y, y.stride(0), weights.contiguous() if has_weights else y, rt.outbox, out,
        handle.num_tokens, plan.hidden, rt.rank, reducers, cfg.senders,
        local_parts(plan, cfg.combine_block_h),
        handle.token_rank_pos, handle.send_chunk_start, handle.recv_chunk_start,
        handle.recv_src_tokens, handle.staged_rows, rt.heap.peer_bases, heap.combine_ready,
        heap.chunk_flags, heap.reduced_flags, heap.staging, rt.control, rt.timeout_ns,
        W=rt.world_size, T_MAX=plan.max_tokens, NC_MAX=plan.max_chunks, H_SLICES=cfg.h_slices,
        P_MAX=MAX_PROGRAMS, MS=plan.meta_stride, MS_P2=next_power_of_2(plan.meta_stride),
        W_P2=next_power_of_2(rt.world_size), CHUNK=cfg.chunk_tokens,
        BLOCK_H=cfg.combine_block_h, COPY_BLOCK_H=cfg.block_h, HAS_WEIGHTS=has_weights,
        COPY_UNROLL=cfg.copy_unroll, LP_MAX=LOCAL_PARTS, STAGES=cfg.copy_stages,
        num_warps=cfg.num_warps, maxnreg=MAX_REGISTERS,
    )  # fmt: skip
    return out
