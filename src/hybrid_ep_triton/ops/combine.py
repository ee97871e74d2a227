"""Combine launch: one persistent kernel, the mirror of the dispatch data move."""

import torch
import triton

from .._planner import MAX_PROGRAMS
from ..kernels.combine import combine_kernel
from . import Runtime
from .dispatch import DispatchHandle


def reduce_tokens(
    rt: Runtime, y: torch.Tensor, handle: DispatchHandle, weights: torch.Tensor | None
) -> torch.Tensor:
    """Sum ``y`` [N, H] (times ``weights`` [N] float32) back into out [T, H]; collective."""
    plan, cfg = rt.plan, rt.plan.config
    out = torch.empty(handle.num_tokens, plan.hidden, dtype=y.dtype, device=rt.device)
    has_weights = weights is not None
    combine_kernel[(cfg.num_programs,)](
        y, y.stride(0), weights.contiguous() if has_weights else y, out, handle.num_tokens,
        plan.hidden, rt.world_size, rt.rank, handle.token_rank_pos, handle.send_chunk_start,
        handle.recv_chunk_start, handle.recv_src_tokens, handle.staged_rows,
        rt.heap.peer_bases, plan.heap.combine_ready, plan.heap.chunk_flags, plan.heap.staging,
        rt.control, rt.timeout_ns,
        T_MAX=plan.max_tokens, NC_MAX=plan.max_chunks, H_SLICES=cfg.h_slices, P_MAX=MAX_PROGRAMS,
        MS=plan.meta_stride, MS_P2=triton.next_power_of_2(plan.meta_stride),
        W_P2=triton.next_power_of_2(rt.world_size), CHUNK=cfg.chunk_tokens,
        BLOCK_H=cfg.combine_block_h, HAS_WEIGHTS=has_weights, COPY_UNROLL=cfg.copy_unroll,
        num_warps=cfg.num_warps,
    )  # fmt: skip
    return out
