"""What a dispatch would send where, counted on this rank alone (no communication): DeepEP's
``get_dispatch_layout``, one launch where torch would take a dozen.

Each program takes BLOCK tokens: for each of its slots in turn, the expert's rank and node;
a token goes to a rank (node) once however many of its experts are there. Counts go into one
zeroed int32 array, by atomic adds: [W] tokens per rank, [N] tokens per node, [E] slots per
expert. Ids outside [0, E) (-1: an unused slot) count nowhere.
"""

import triton
import triton.language as tl


@triton.jit
def token_counts_kernel(
    topk_idx_ptr,  # in [T, K] int32 or int64 global expert ids
    num_tokens,
    topk,
    num_experts,
    experts_per_rank,
    ranks_per_node,
    counts_ptr,  # out int32 [W + N + E], zeroed: tokens per rank, per node, slots per expert
    token_in_rank_ptr,  # out uint8 [T, W]: 1 where the token has an expert on the rank
    W: tl.constexpr,
    NODES: tl.constexpr,
    W_P2: tl.constexpr,
    N_P2: tl.constexpr,
    BLOCK: tl.constexpr,
):
    tokens = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = tokens < num_tokens
    ranks = tl.arange(0, W_P2)
    nodes = tl.arange(0, N_P2)
    in_rank = tl.zeros([BLOCK, W_P2], dtype=tl.int32)
    in_node = tl.zeros([BLOCK, N_P2], dtype=tl.int32)
    for slot in range(topk):
        expert = tl.load(topk_idx_ptr + tokens.to(tl.int64) * topk + slot, mask=live, other=-1)
        expert = expert.to(tl.int32)
        valid = (expert >= 0) & (expert < num_experts)
        tl.atomic_add(counts_ptr + W + NODES + expert, 1, mask=valid, sem="relaxed")
        rank = tl.where(valid, expert // experts_per_rank, -1)
        node = tl.where(valid, rank // ranks_per_node, -1)
        in_rank = tl.maximum(in_rank, (rank[:, None] == ranks[None, :]).to(tl.int32))
        in_node = tl.maximum(in_node, (node[:, None] == nodes[None, :]).to(tl.int32))
    out = token_in_rank_ptr + tokens[:, None].to(tl.int64) * W + ranks[None, :]
    tl.store(out, in_rank.to(tl.uint8), mask=live[:, None] & (ranks[None, :] < W))
    tl.atomic_add(counts_ptr + ranks, tl.sum(in_rank, axis=0), mask=ranks < W, sem="relaxed")
    if NODES > 1:
        per_node = tl.sum(in_node, axis=0)
        tl.atomic_add(counts_ptr + W + nodes, per_node, mask=nodes < NODES, sem="relaxed")
