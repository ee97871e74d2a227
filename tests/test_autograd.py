"""Gradients through dispatch and combine against a single-process reference model (fp32, on
the CPU).

Every rank builds every rank's inputs from the same seeds, routes its own tokens with a router
(linear + softmax + top-k), dispatches them, applies one linear map per expert, combines with the
routing weights and backpropagates a random projection of the output. The reference computes the
same function on all tokens in one process: x gradients must match this rank's slice, and the
router weight gradient (summed over ranks) the reference's.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from conftest import assert_no_failures

from hybrid_ep_triton import Buffer
from hybrid_ep_triton.tools.launcher import rank_device

HIDDEN, EXPERTS_PER_RANK, TOPK, MAX_TOKENS = 6, 2, 3, 7
TOL = 1e-4


def _model(world: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    experts = world * EXPERTS_PER_RANK
    tokens = [int(t) for t in torch.randint(0, MAX_TOKENS + 1, (world,), generator=g)]
    xs = [torch.randn(t, HIDDEN, generator=g) for t in tokens]
    router = torch.randn(HIDDEN, experts, generator=g)
    maps = torch.randn(experts, HIDDEN, HIDDEN, generator=g) / HIDDEN**0.5
    projections = [torch.randn(t, HIDDEN, generator=g) for t in tokens]
    return xs, router, maps, projections


def _route(x: torch.Tensor, router: torch.Tensor):
    weights, idx = torch.softmax(x @ router, dim=1).topk(TOPK, dim=1)
    return idx, weights


def _reference_grads(xs, router, maps, projections):
    x = torch.cat(xs).requires_grad_(True)
    router = router.clone().requires_grad_(True)
    idx, weights = _route(x, router)
    expert_out = torch.einsum("th,tkhj->tkj", x, maps[idx])
    out = (weights[:, :, None] * expert_out).sum(dim=1)
    (out * torch.cat(projections)).sum().backward()
    return x.grad, router.grad


def _expert_major_out(buf: Buffer, rank: int, x, idx, weights, maps, kw: dict):
    """The MoE layer's output with expert-major rows: weights applied by combine."""
    recv_x, recv_w, tokens_per_expert, handle = buf.dispatch(x, idx, weights, **kw)
    # Each row's local expert; rows past the segments (zero tail) take expert 0.
    local = torch.repeat_interleave(
        torch.arange(EXPERTS_PER_RANK, device=recv_x.device), tokens_per_expert
    )
    local = torch.cat([local, local.new_zeros(recv_x.shape[0] - local.numel())])
    y = torch.einsum("nh,nhj->nj", recv_x, maps[rank * EXPERTS_PER_RANK + local])
    return buf.combine(y, handle, weights=recv_w)


def _token_rows_out(buf: Buffer, rank: int, x, idx, weights, maps, kw: dict):
    """The same with one row per token (expand=False): each row sums its weighted experts."""
    recv_x, recv_idx, recv_w, _, handle = buf.dispatch(x, idx, weights, **kw)
    expert_maps = maps[rank * EXPERTS_PER_RANK + recv_idx.long().clamp(min=0)]  # [N, K, H, H]
    per_slot = torch.einsum("nh,nkhj->nkj", recv_x, expert_maps)
    y = (torch.where(recv_idx >= 0, recv_w, 0.0)[:, :, None] * per_slot).sum(dim=1)
    return buf.combine(y, handle)


def _grad_body(rank: int, world: int, cases: list[dict], ranks_per_node: int | None) -> list[str]:
    failures = []
    for expand, layer_out in ((True, _expert_major_out), (False, _token_rows_out)):
        failures += _check_grads(rank, world, cases, expand, layer_out, ranks_per_node)
    return failures


def _check_grads(
    rank: int, world: int, cases: list[dict], expand: bool, layer_out, ranks_per_node
) -> list[str]:
    failures = []
    dev = rank_device()
    with Buffer(
        None,
        device=dev,
        hidden_size=HIDDEN,
        max_tokens_per_rank=MAX_TOKENS,
        num_experts=world * EXPERTS_PER_RANK,
        dtype=torch.float32,
        expand=expand,
        ranks_per_node=ranks_per_node,
    ) as buf:
        for case in cases:
            if not expand and "pad_multiple" in case:
                continue
            what = f"rank {rank}, expand={expand}, ranks_per_node={ranks_per_node}, {case}"
            xs, router_weight, maps, projections = _model(world, case["seed"])
            x = xs[rank].to(dev, copy=True).requires_grad_(True)
            router = router_weight.to(dev, copy=True).requires_grad_(True)
            idx, weights = _route(x, router)
            kw = {k: v for k, v in case.items() if k != "seed"}
            out = layer_out(buf, rank, x, idx, weights, maps.to(dev), kw)
            (out * projections[rank].to(dev)).sum().backward()
            router_grad = router.grad.clone()
            dist.all_reduce(router_grad)
            x_grad, router_grad = x.grad.cpu(), router_grad.cpu()
            ref_x, ref_router = _reference_grads(xs, router_weight, maps, projections)
            start = sum(t.shape[0] for t in xs[:rank])
            ref_x = ref_x[start : start + x.shape[0]]
            if not torch.allclose(x_grad, ref_x, atol=TOL, rtol=TOL):
                failures.append(f"{what}: x grad off by {(x_grad - ref_x).abs().max():.2e}")
            if not torch.allclose(router_grad, ref_router, atol=TOL, rtol=TOL):
                err = (router_grad - ref_router).abs().max()
                failures.append(f"{what}: router grad off by {err:.2e}")
    return failures


CASES = [
    {"seed": 1},
    {"seed": 2, "pad_multiple": 3},
    {"seed": 3, "max_recv_tokens": 64},
    {"seed": 4, "pad_multiple": 2, "max_recv_tokens": 80},
]


@pytest.mark.slow
def test_gradients_match_a_single_process_model(launch):
    # 2 ranks as 2 nodes (every transfer a network put), 3 ranks in one node.
    for world, ranks_per_node in ((2, 1), (3, None)):
        results = launch(_grad_body, world, CASES, ranks_per_node)
        assert_no_failures(results)
