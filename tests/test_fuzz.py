"""Fuzzing: hypothesis draws whole scenarios — world size, hidden size, experts, and a sequence of
calls with random token counts, routings (-1 slots, hot experts, empty ranks), pad multiples,
max_recv_tokens values and weights, expert-major rows or token rows (expand), one node or
simulated nodes of 1 or 2 ranks (ranks_per_node, where it divides the world) — and every call
is checked against the reference. One scenario is one call of the ranks, its calls share one
Buffer. Sizes follow the device: a few tokens of a few channels on CPU ranks (the interpreter),
up to hundreds of tokens of up to 7168 channels, 8 ranks and top-8 of 256 experts on GPUs.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from conftest import DEVICE, assert_no_failures
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybrid_ep_triton import Buffer, reference
from hybrid_ep_triton.tools.launcher import rank_device
from hybrid_ep_triton.tools.soak import _row_weights

ON_GPU = DEVICE == "cuda"
MAX_TOKENS = 300 if ON_GPU else 6
MAX_WORLD = 8 if ON_GPU else 4
TOL = 2e-2  # bf16; combine sends bf16 partial sums per (token, rank)

calls = st.fixed_dictionaries(
    {
        "seed": st.integers(0, 2**31 - 1),
        "tokens": st.lists(st.integers(0, MAX_TOKENS), min_size=MAX_WORLD, max_size=MAX_WORLD),
        "topk": st.integers(1, 8 if ON_GPU else 3),
        "unused": st.sampled_from([0.0, 0.3, 1.0]),
        "hot": st.booleans(),
        "pad_multiple": st.sampled_from([1, 2, 5]),
        "max_recv_tokens": st.one_of(st.none(), st.integers(0, 40)),
        "weights": st.booleans(),
    }
)
scenarios = st.fixed_dictionaries(
    {
        "world": st.integers(2, MAX_WORLD),
        "hidden": st.sampled_from([7, 1000, 7168] if ON_GPU else [3, 10, 33]),
        "experts_per_rank": st.sampled_from([1, 3, 32] if ON_GPU else [1, 2, 3]),
        "expand": st.booleans(),
        "ranks_per_node": st.sampled_from([None, 1, 2]),
        # On GPUs a scenario's first call compiles its kernels (20 to 75 s on an H200 host):
        # fewer scenarios of more calls each.
        "calls": st.lists(calls, min_size=4 if ON_GPU else 3, max_size=8 if ON_GPU else 5),
    }
)


def _inputs(call: dict, rank: int, experts: int, hidden: int):
    """x, topk_idx and topk_weights of one rank: distinct ids per row, -1 slots, maybe every row
    on one hot expert."""
    g = torch.Generator().manual_seed(call["seed"] * 7 + rank)
    num_tokens, topk = call["tokens"][rank], min(call["topk"], experts)
    idx = torch.rand(num_tokens, experts, generator=g).argsort(dim=1)[:, :topk]
    if call["hot"] and num_tokens:
        # Expert 0 in every row, kept distinct by swapping it into slot 0.
        has_zero = idx == 0
        idx[has_zero] = idx[:, :1].expand_as(idx)[has_zero]
        idx[:, 0] = 0
    idx[torch.rand(idx.shape, generator=g) < call["unused"]] = -1
    weights = torch.rand(idx.shape, generator=g) if call["weights"] else None
    x = torch.randn(num_tokens, hidden, generator=g).to(torch.bfloat16)
    dev = rank_device()
    return x.to(dev), idx.to(dev), None if weights is None else weights.to(dev)


def _scenario_body(rank: int, world: int, scenario: dict) -> list[str]:
    experts = world * scenario["experts_per_rank"]
    expand = scenario["expand"]
    names = ["recv_x", "recv_weights", "tokens_per_expert"]
    if not expand:
        names = ["recv_x", "recv_topk_idx", "recv_topk_weights", "tokens_per_expert"]
    failures = []
    per_node = scenario["ranks_per_node"]
    if per_node is not None and world % per_node:
        per_node = None
    with Buffer(
        None,
        hidden_size=scenario["hidden"],
        max_tokens_per_rank=MAX_TOKENS,
        num_experts=experts,
        expand=expand,
        ranks_per_node=per_node,
        device=rank_device(),
    ) as buf:
        for n, call in enumerate(scenario["calls"]):
            what = f"rank {rank}, expand={expand}, ranks_per_node={per_node}, call {n} {call}"
            x, idx, w = _inputs(call, rank, experts, scenario["hidden"])
            kw = dict(
                pad_multiple=call["pad_multiple"] if expand else 1,
                max_recv_tokens=call["max_recv_tokens"],
            )
            *got, handle = buf.dispatch(x, idx, w, **kw)
            *want, ref_handle = reference.dispatch(
                None, x, idx, w, num_experts=experts, expand=expand, **kw
            )
            for name, a, b in zip(names, got, want, strict=True):
                if (a is None) != (b is None) or a is not None and not torch.equal(a, b):
                    failures.append(f"{what}: {name} differs from the reference")
            limit = call["max_recv_tokens"]
            overflow = limit is not None and ref_handle.num_recv_rows > limit
            try:
                buf.check(handle)
                if overflow:
                    failures.append(f"{what}: no OverflowError")
            except OverflowError:
                if not overflow:
                    failures.append(f"{what}: unexpected OverflowError")
            y = torch.randn(got[0].shape, generator=torch.Generator().manual_seed(n))
            y = y.to(torch.bfloat16).to(buf.device)
            weighted = w is not None
            out = buf.combine(y, handle, weights=_row_weights(got, expand, weighted))
            ref_weights = _row_weights(want, expand, weighted)
            ref = reference.combine(None, y, ref_handle, weights=ref_weights)
            scale = 1 + ref.float().abs()
            if not ((out.float() - ref.float()).abs() <= TOL * scale).all():
                failures.append(f"{what}: combine differs from the reference")
    dist.barrier()
    return failures


@pytest.mark.slow
@settings(
    max_examples=6 if ON_GPU else 3,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(scenario=scenarios)
def test_random_scenarios_match_the_reference(launch, scenario):
    results = launch(_scenario_body, scenario["world"], scenario)
    assert_no_failures(results)
