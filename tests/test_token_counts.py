"""Buffer.token_counts (what a dispatch would send where, on one rank) against plain torch."""

import pytest
import torch

from hybrid_ep_triton import Buffer


def _reference(topk_idx, num_experts, world, ranks_per_node):
    """Plain torch, on the host: per rank, per node (None in one node), per expert, in_rank."""
    idx = topk_idx.cpu().long()
    valid = (idx >= 0) & (idx < num_experts)
    ranks = torch.where(valid, idx // (num_experts // world), -1)
    in_rank = torch.stack([(ranks == r).any(1) for r in range(world)], 1)
    nodes = world // ranks_per_node
    per_node = None
    if nodes > 1:
        in_node = in_rank.view(-1, nodes, ranks_per_node).any(2)
        per_node = in_node.sum(0).int()
    per_expert = torch.bincount(idx[valid], minlength=num_experts).int()
    return in_rank.sum(0).int(), per_node, per_expert, in_rank


@pytest.mark.parametrize(
    "tokens, topk, experts, world, ranks_per_node, dtype",
    [
        (0, 2, 8, 2, 2, torch.int64),  # no tokens
        (5, 3, 12, 4, 2, torch.int64),  # two nodes, odd counts
        (130, 8, 64, 8, 4, torch.int32),  # more than one program of tokens, int32 ids
        (77, 1, 16, 16, 4, torch.int64),  # one slot, one expert a rank, four nodes
        (40, 6, 256, 1, 1, torch.int64),  # world 1
        (40, 8, 256, 256, 256, torch.int64),  # an expert a "rank" (HybridEP's routing map)
    ],
)
@pytest.mark.parametrize("hot", [False, True])
def test_counts_match_plain_torch(device, tokens, topk, experts, world, ranks_per_node, dtype, hot):
    g = torch.Generator().manual_seed(tokens * 31 + topk)
    # -1 slots and ids past the last expert, which count nowhere.
    idx = torch.randint(-1, experts + 2, (tokens, topk), generator=g)
    if hot:  # one expert in half of the tokens' first slots
        idx[: tokens // 2, 0] = experts - 1
    got = Buffer.token_counts(idx.to(device, dtype), experts, world, ranks_per_node)
    want = _reference(idx, experts, world, ranks_per_node)
    names = "tokens_per_rank", "tokens_per_node", "tokens_per_expert", "token_in_rank"
    for name, g_value, w_value in zip(names, got, want, strict=True):
        if w_value is None:
            assert g_value is None, name
        else:
            assert g_value.device.type == device and torch.equal(g_value.cpu(), w_value), name


@pytest.mark.parametrize(
    "arguments, named",
    [
        ((torch.zeros(4, 2, dtype=torch.int64), 6, 4), "num_experts"),
        ((torch.zeros(4, 2, dtype=torch.int64), 8, 4, 3), "world_size"),
        ((torch.zeros(4, 2, dtype=torch.float32), 8, 4), "topk_idx"),
        ((torch.zeros(8, dtype=torch.int64), 8, 4), "topk_idx"),
    ],
)
def test_bad_arguments_are_named(arguments, named):
    with pytest.raises(ValueError, match=named):
        Buffer.token_counts(*arguments)
