"""Fuzzing: hypothesis draws whole scenarios — world size, hidden size, experts, and a sequence of
calls with random token counts, routings (-1 slots, hot experts, empty ranks), pad multiples,
max_recv_tokens values and weights — and every call on CPU ranks is checked against the
reference. One scenario is one launch of ranks (a launch costs seconds), its calls share one
Buffer.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybrid_ep_triton import Buffer, reference

MAX_TOKENS = 6
TOL = 2e-2  # bf16; combine sends bf16 partial sums per (token, rank)

calls = st.fixed_dictionaries(
    {
        "seed": st.integers(0, 2**31 - 1),
        "tokens": st.lists(st.integers(0, MAX_TOKENS), min_size=4, max_size=4),
        "topk": st.integers(1, 3),
        "unused": st.sampled_from([0.0, 0.3, 1.0]),
        "hot": st.booleans(),
        "pad_multiple": st.sampled_from([1, 2, 5]),
        "max_recv_tokens": st.one_of(st.none(), st.integers(0, 40)),
        "weights": st.booleans(),
    }
)
scenarios = st.fixed_dictionaries(
    {
        "world": st.integers(2, 4),
        "hidden": st.sampled_from([3, 10, 33]),
        "experts_per_rank": st.integers(1, 3),
        "calls": st.lists(calls, min_size=3, max_size=5),
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
    return x, idx, weights


def _scenario_body(rank: int, world: int, scenario: dict) -> list[str]:
    experts = world * scenario["experts_per_rank"]
    failures = []
    with Buffer(
        None, hidden_size=scenario["hidden"], max_tokens_per_rank=MAX_TOKENS, num_experts=experts
    ) as buf:
        for n, call in enumerate(scenario["calls"]):
            what = f"rank {rank}, call {n} {call}"
            x, idx, w = _inputs(call, rank, experts, scenario["hidden"])
            kw = dict(pad_multiple=call["pad_multiple"], max_recv_tokens=call["max_recv_tokens"])
            got = buf.dispatch(x, idx, w, **kw)
            want = reference.dispatch(None, x, idx, w, num_experts=experts, **kw)
            names = ("recv_x", "recv_weights", "tokens_per_expert")
            for name, a, b in zip(names, got[:3], want[:3], strict=True):
                if (a is None) != (b is None) or a is not None and not torch.equal(a, b):
                    failures.append(f"{what}: {name} differs from the reference")
            limit = call["max_recv_tokens"]
            overflow = limit is not None and want[3].num_recv_rows > limit
            try:
                buf.check(got[3])
                if overflow:
                    failures.append(f"{what}: no OverflowError")
            except OverflowError:
                if not overflow:
                    failures.append(f"{what}: unexpected OverflowError")
            y = torch.randn(got[0].shape, generator=torch.Generator().manual_seed(n))
            y = y.to(torch.bfloat16)
            out = buf.combine(y, got[3], weights=got[1])
            ref = reference.combine(None, y, want[3], weights=want[1])
            scale = 1 + ref.float().abs()
            if not ((out.float() - ref.float()).abs() <= TOL * scale).all():
                failures.append(f"{what}: combine differs from the reference")
    dist.barrier()
    return failures


@settings(
    max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(scenario=scenarios)
def test_random_scenarios_match_the_reference(launch, scenario):
    results = launch(_scenario_body, scenario["world"], scenario)
    failures = [msg for per_rank in results for msg in per_rank]
    assert not failures, "\n".join(failures)
