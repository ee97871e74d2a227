"""``Buffer.token_counts``: what a dispatch of ``topk_idx`` would send where, counted on this
rank alone in one launch (kernels/token_counts.py), for adapters whose API has such a call
(DeepEP's get_dispatch_layout); a dispatch counts for itself."""

import contextlib
import functools

import torch
from triton import cdiv, next_power_of_2

from ..kernels.token_counts import token_counts_kernel
from ..runtime.checks import describe
from .launch import KernelLauncher

# Elements of a program's [BLOCK, W_P2] tile of ranks: it stays in registers.
_TILE = 4096


def _block(world_size: int) -> int:
    """Tokens a program takes: 64, fewer where W is large (an expert a "rank", as HybridEP's
    routing maps count)."""
    return max(1, min(64, _TILE // next_power_of_2(world_size)))


@functools.cache
def _launcher(world_size: int, nodes: int) -> KernelLauncher:
    return KernelLauncher(
        token_counts_kernel,
        W=world_size,
        NODES=nodes,
        W_P2=next_power_of_2(world_size),
        N_P2=next_power_of_2(nodes),
        BLOCK=_block(world_size),
        num_warps=4,
    )


def token_counts(
    topk_idx: torch.Tensor, num_experts: int, world_size: int, ranks_per_node: int | None = None
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """What a dispatch of ``topk_idx`` sends where, on ``topk_idx``'s device and current stream,
    with no communication and no host synchronisation (a CUDA graph captures it).

    Args:
        topk_idx: [T, K] int32 or int64 global expert ids; -1 (an unused slot) and any id
            outside [0, num_experts) count nowhere (a dispatch refuses the latter).
        num_experts: E, a positive multiple of world_size.
        world_size: W, the ranks of the group.
        ranks_per_node: R, ranks a node (None: W, one node); W a multiple of it.

    Returns: tokens_per_rank [W] int32 (tokens with an expert on each rank), tokens_per_node
    [W / R] int32 (None within one node), tokens_per_expert [E] int32 (slots routed to each
    expert), token_in_rank [T, W] bool.
    """
    ranks_per_node = ranks_per_node or world_size
    if not (isinstance(world_size, int) and world_size > 0 and world_size % ranks_per_node == 0):
        raise ValueError(
            f"world_size must be a positive multiple of ranks_per_node ({ranks_per_node}), "
            f"got {world_size}"
        )
    if not (isinstance(num_experts, int) and num_experts > 0 and num_experts % world_size == 0):
        raise ValueError(f"num_experts must be a positive multiple of {world_size}: {num_experts}")
    if not (
        isinstance(topk_idx, torch.Tensor)
        and topk_idx.dim() == 2
        and topk_idx.dtype in (torch.int32, torch.int64)
    ):
        why = f"topk_idx must be a [T, K] int32 or int64 tensor, got {describe(topk_idx)}"
        raise ValueError(why)
    topk_idx = topk_idx.contiguous()
    num_tokens, topk = topk_idx.shape
    nodes = world_size // ranks_per_node
    device = topk_idx.device
    counts = torch.zeros(world_size + nodes + num_experts, dtype=torch.int32, device=device)
    token_in_rank = torch.empty(num_tokens, world_size, dtype=torch.bool, device=device)
    if num_tokens:
        with torch.cuda.device(device) if topk_idx.is_cuda else contextlib.nullcontext():
            _launcher(world_size, nodes)(
                (cdiv(num_tokens, _block(world_size)),),
                specialized=dict(
                    topk_idx_ptr=topk_idx,
                    num_tokens=num_tokens,
                    topk=topk,
                    num_experts=num_experts,
                    experts_per_rank=num_experts // world_size,
                    ranks_per_node=ranks_per_node,
                ),
                aligned=dict(counts_ptr=counts, token_in_rank_ptr=token_in_rank.view(torch.uint8)),
            )
    per_node = counts[world_size : world_size + nodes] if nodes > 1 else None
    return counts[:world_size], per_node, counts[world_size + nodes :], token_in_rank
