"""Combine launch: one kernel whose reducers and finishers (the rest of the GPU) surround the
sending programs."""

import torch

from ..kernels.combine import combine_kernel
from ..runtime.planner import LOCAL_PARTS, MAX_TOPK, next_power_of_2
from .geometry import (
    channel_programs,
    data_move_arguments,
    local_parts,
    programs_beside_senders,
    topology_constants,
)
from .handle import DispatchHandle
from .launch import KernelLauncher
from .runtime import Runtime


def _reducers(local: int, world: int) -> int:
    """Local programs that reduce the other ranks' rows: those rows are (W - 1) / W of the
    expert rows a rank gathers, and the finishers gather the rest, then add the partial rows."""
    return min(max(round(local * (world - 1) / world), 1), local - 1)


def _combine_launcher(rt: Runtime) -> KernelLauncher:
    """combine_kernel with the arguments that stay the same for a Buffer."""
    plan, cfg, heap = rt.plan, rt.plan.config, rt.plan.heap
    return KernelLauncher(
        combine_kernel,
        outbox_ptr=rt.outbox,
        hidden=plan.hidden,
        num_reducers=_reducers(programs_beside_senders(rt), rt.world_size),
        local_parts=local_parts(plan, cfg.combine_block_h),
        ready_off=heap.combine_ready,
        reduced_flags_off=heap.reduced_flags,
        slot_weights_off=heap.slot_weights,
        BLOCK_H=cfg.combine_block_h,
        COPY_BLOCK_H=cfg.block_h,
        COPY_UNROLL=cfg.copy_unroll,
        LP_MAX=LOCAL_PARTS,
        SW=MAX_TOPK,
        NET_COLS=plan.net_slot.cols,
        **data_move_arguments(rt),
        **topology_constants(plan, "N_P2"),
    )


def reduce_tokens(
    rt: Runtime,
    y: torch.Tensor,
    handle: DispatchHandle,
    weights: torch.Tensor | None,
    topk_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Sum ``y`` [N, H] (times ``weights`` [N] float32) back into out [T, H], and with token
    rows ``topk_weights`` [N, K] float32 into combined_weights [T, K] (else None); collective."""
    out = torch.empty(handle.num_tokens, rt.plan.hidden, dtype=y.dtype, device=rt.device)
    has_weights, slot_weights = weights is not None, topk_weights is not None
    weights = weights.contiguous() if has_weights else y
    combined = None
    if slot_weights:
        topk_weights = topk_weights.contiguous()
        combined = torch.empty(
            handle.num_tokens, handle.topk, dtype=torch.float32, device=rt.device
        )
    unused = rt.placeholder(torch.float32)
    changing = (
        y,
        y.stride(0),
        weights,
        topk_weights if slot_weights else unused,
        out,
        combined if slot_weights else unused,
    )
    # The arguments a repeated call changes (the others are fixed by the key).
    key = ("combine", has_weights, slot_weights, handle.num_tokens, handle.topk)
    relaunch = rt.relaunches.get(key)
    if relaunch is not None and relaunch(*changing, handle.state.data_ptr()):
        return out, combined
    rt.relaunches[key] = rt.launcher(_combine_launcher)(
        (channel_programs(rt.plan) + programs_beside_senders(rt),),
        specialized=dict(
            y_ptr=y,
            y_stride=y.stride(0),
            weights_ptr=weights,
            topk_weights_ptr=changing[3],
            num_tokens=handle.num_tokens,
            topk=handle.topk,
            HAS_WEIGHTS=has_weights,
            SLOT_WEIGHTS=slot_weights,
            K_P2=next_power_of_2(handle.topk),
        ),
        aligned=dict(out_ptr=out, combined_weights_ptr=changing[5], **handle.args(*_COMBINE_PARTS)),
        changing=(
            "y_ptr",
            "y_stride",
            "weights_ptr",
            "topk_weights_ptr",
            "out_ptr",
            "combined_weights_ptr",
        ),
        views_of=handle.ints,
    )
    return out, combined


# The handle parts combine reads.
_COMBINE_PARTS = (
    "token_rank_pos",
    "send_chunk_start",
    "recv_chunk_start",
    "recv_src_tokens",
    "staged_rows",
    "token_node_pos",
    "recv_net_chunk_start",
    "fwd_rows",
)
