"""Check ``hybrid_ep_triton.reference`` against a brute-force oracle.

The oracle shares nothing with the reference but the inputs: every rank all-gathers all ranks'
``x`` / ``topk_idx`` / ``topk_weights`` (and later every rank's ``y``) as Python objects, then
builds the expected dispatch layout row by row and the expected combine output token by token
in plain Python loops, accumulating in float64.

All cases for one world size run inside a single spawn of ranks, because each spawn costs
seconds; each rank returns a list of failure messages so that one run reports every bad case.
The reference runs on the test device (gloo + CPU tensors, or NCCL + CUDA tensors under
HEP_TEST_DEVICE=cuda); the oracle always works on CPU copies.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from hybrid_ep_triton import reference


@dataclass(frozen=True)
class Case:
    """One dispatch + combine scenario; inputs are drawn from a per-(case, rank) seed."""

    name: str
    seed: int
    hidden: int = 7
    topk: int = 3
    experts_per_rank: int = 2
    dtype: torch.dtype = torch.float32
    idx_dtype: torch.dtype = torch.int64
    with_weights: bool = True
    pad_multiple: int = 1
    max_recv_tokens: int | None = None
    tokens: tuple[int, ...] = (9, 13, 6, 11)  # tokens of rank r: tokens[r % len(tokens)]
    unused_prob: float = 0.0  # chance that a top-k slot is -1
    hot_expert: bool = False  # every token picks global expert 0 (on rank 0) in slot 0


BF16, FP16, I32 = torch.bfloat16, torch.float16, torch.int32
CASES = [
    Case("basic", 1, experts_per_rank=3),
    Case("unused_slots", 2, hidden=33, topk=4, unused_prob=0.4),
    Case(
        "bf16_int32_pad4", 3, hidden=33, dtype=BF16, idx_dtype=I32, pad_multiple=4, unused_prob=0.2
    ),
    Case("no_weights_int32", 4, topk=2, idx_dtype=I32, with_weights=False, unused_prob=0.2),
    Case("fp16_one_expert_per_rank", 5, hidden=5, topk=1, experts_per_rank=1, dtype=FP16),
    Case("hot_expert", 6, hot_expert=True),
    Case(
        "hot_expert_bf16_pad4",
        7,
        hidden=33,
        topk=2,
        experts_per_rank=3,
        dtype=BF16,
        pad_multiple=4,
        hot_expert=True,
        unused_prob=0.3,
    ),
    Case("one_rank_empty", 8, pad_multiple=4, tokens=(10, 0, 7, 12)),
    Case("all_ranks_empty", 9, tokens=(0,)),
    Case("all_ranks_empty_zero_tail", 10, pad_multiple=4, max_recv_tokens=8, tokens=(0,)),
    Case("all_slots_unused", 11, unused_prob=1.0),
    Case("zero_tail", 12, hidden=33, max_recv_tokens=200, unused_prob=0.2),
    Case("zero_tail_pad4_no_weights", 13, with_weights=False, pad_multiple=4, max_recv_tokens=200),
    Case("truncate", 14, max_recv_tokens=5),
    Case(
        "truncate_pad4_bf16",
        15,
        hidden=33,
        dtype=BF16,
        pad_multiple=4,
        max_recv_tokens=10,
        hot_expert=True,
        unused_prob=0.2,
    ),
    Case("truncate_to_zero", 16, topk=2, max_recv_tokens=0),
]


def _make_inputs(case: Case, rank: int, world: int):
    """Random ``x [T, H]``, ``topk_idx [T, K]`` (distinct ids, -1 slots) and weights."""
    gen = torch.Generator().manual_seed(1000 * case.seed + rank)
    num_experts = world * case.experts_per_rank
    num_tokens = case.tokens[rank % len(case.tokens)]
    x = torch.randn(num_tokens, case.hidden, generator=gen).to(case.dtype)
    rows = []
    for _ in range(num_tokens):
        ids = torch.randperm(num_experts, generator=gen)[: case.topk].tolist()
        if case.hot_expert:
            ids = [0, *[e for e in ids if e != 0][: case.topk - 1]]
        unused = torch.rand(case.topk, generator=gen) < case.unused_prob
        rows.append([-1 if u else e for e, u in zip(ids, unused.tolist(), strict=True)])
    topk_idx = torch.tensor(rows, dtype=case.idx_dtype).reshape(num_tokens, case.topk)
    weights = None
    if case.with_weights:
        weights = torch.rand(num_tokens, case.topk, generator=gen)
    return x, topk_idx, weights


def _oracle_layout(case: Case, inputs, dst: int, world: int):
    """Expected recv rows of rank ``dst``: (x row, weight, owner) per row, and per-expert rows.

    ``owner`` is ``(src rank, token, global expert)``, or None for padding. The list is the
    exact layout; truncation / zero tail are applied by the caller.
    """
    rows, per_expert = [], []
    hidden = case.hidden
    for local in range(case.experts_per_rank):
        expert = dst * case.experts_per_rank + local
        count = 0
        for src in range(world):
            x, topk_idx, weights = inputs[src]
            for t in range(x.shape[0]):
                ids = topk_idx[t].tolist()
                if expert in ids:
                    w = float(weights[t, ids.index(expert)]) if weights is not None else 0.0
                    rows.append((x[t], w, (src, t, expert)))
                    count += 1
        while count % case.pad_multiple:
            rows.append((torch.zeros(hidden, dtype=case.dtype), 0.0, None))
            count += 1
        per_expert.append(count)
    return rows, per_expert


def _oracle_token_rows(case: Case, inputs, dst: int, world: int):
    """Expected rows of rank ``dst`` with expand=False: (x row, {slot: local id}, {slot:
    weight}, owner) per received token, in source order, and the (token, expert) pairs per
    local expert."""
    rows, per_expert = [], [0] * case.experts_per_rank
    for src in range(world):
        x, topk_idx, weights = inputs[src]
        for t in range(x.shape[0]):
            slots = [
                k
                for k, e in enumerate(topk_idx[t].tolist())
                if e // case.experts_per_rank == dst and e >= 0
            ]
            if not slots:
                continue
            local = {k: int(topk_idx[t, k]) % case.experts_per_rank for k in slots}
            for e in local.values():
                per_expert[e] += 1
            ws = {k: float(weights[t, k]) for k in slots} if weights is not None else {}
            rows.append((x[t], local, ws, (src, t)))
    return rows, per_expert


def _check_token_rows(case: Case, inputs, rank: int, world: int, dev, check) -> None:
    """reference.dispatch and combine with expand=False against the oracle."""
    x, topk_idx, weights = inputs[rank]
    recv_x, recv_idx, recv_w, tokens_per_expert, handle = reference.dispatch(
        dist.group.WORLD,
        x.to(dev),
        topk_idx.to(dev),
        None if weights is None else weights.to(dev),
        num_experts=world * case.experts_per_rank,
        max_recv_tokens=case.max_recv_tokens,
        expand=False,
    )
    layouts = [_oracle_token_rows(case, inputs, dst, world) for dst in range(world)]
    rows, per_expert = layouts[rank]
    limit = len(rows) if case.max_recv_tokens is None else case.max_recv_tokens
    k = case.topk
    want_x = torch.zeros(limit, case.hidden, dtype=case.dtype)
    want_idx = torch.full((limit, k), -1, dtype=topk_idx.dtype)
    want_w = torch.zeros(limit, k)
    want_src = torch.full((limit,), -1, dtype=torch.int32)
    for j, (row, local, ws, (_, t)) in enumerate(rows[:limit]):
        want_x[j] = row
        want_src[j] = t
        for slot, e in local.items():
            want_idx[j, slot] = e
        for slot, w in ws.items():
            want_w[j, slot] = w
    check("token rows: recv_x", torch.equal(recv_x.cpu(), want_x), f"\n{recv_x}\n{want_x}")
    check("token rows: recv_topk_idx", torch.equal(recv_idx.cpu(), want_idx), f"{recv_idx}")
    if weights is not None:
        check("token rows: recv_topk_weights", torch.equal(recv_w.cpu(), want_w), f"{recv_w}")
    else:
        check("token rows: recv_topk_weights", recv_w is None, "should be None")
    got = tokens_per_expert.cpu().tolist()
    check("token rows: tokens_per_expert", got == per_expert, f"{got} expected {per_expert}")
    got_src = handle.recv_src_idx.cpu()
    check("token rows: recv_src_idx", torch.equal(got_src, want_src), f"{got_src} {want_src}")

    gen = torch.Generator().manual_seed(1000 * case.seed + 700 + rank)
    y = torch.randn(recv_x.shape, generator=gen).to(case.dtype)
    slot_values = torch.randn(recv_x.shape[0], k, generator=gen)
    out, summed = reference.combine(
        dist.group.WORLD, y.to(dev), handle, topk_weights=slot_values.to(dev)
    )
    all_y = [None] * world
    dist.all_gather_object(all_y, (y, slot_values))
    expected_out = torch.zeros(x.shape[0], case.hidden, dtype=torch.float64)
    expected_summed = torch.zeros(x.shape[0], k, dtype=torch.float64)
    for dst, (y_dst, values_dst) in enumerate(all_y):
        for j, (*_, (src, t)) in enumerate(layouts[dst][0][: y_dst.shape[0]]):
            if src == rank:
                expected_out[t] += y_dst[j].double()
                expected_summed[t] += values_dst[j].double()
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[case.dtype]
    ok = torch.allclose(out.cpu().double(), expected_out, rtol=tol, atol=tol)
    check("token rows: combine", ok, f"\n{out}\nexpected\n{expected_out}")
    ok = torch.allclose(summed.cpu().double(), expected_summed, rtol=1e-6, atol=1e-6)
    check("token rows: combined topk_weights", ok, f"\n{summed}\n{expected_summed}")


def _fit(case: Case, rows, per_expert):
    """Apply ``max_recv_tokens``: keep a prefix, pad with zero rows, clip per-expert counts."""
    if case.max_recv_tokens is None:
        return rows, per_expert
    limit = case.max_recv_tokens
    rows = rows[:limit]
    while len(rows) < limit:
        rows.append((torch.zeros(case.hidden, dtype=case.dtype), 0.0, None))
    clipped, left = [], limit
    for count in per_expert:
        clipped.append(min(count, left))
        left -= clipped[-1]
    return rows, clipped


def _run_case(case: Case, rank: int, world: int, dev: torch.device, failures: list[str]) -> None:
    def check(what: str, ok: bool, detail: str) -> None:
        if not ok:
            failures.append(f"{case.name}: {what} {detail}")

    group = dist.group.WORLD
    x, topk_idx, weights = _make_inputs(case, rank, world)
    inputs = [None] * world
    dist.all_gather_object(inputs, (x, topk_idx, weights))

    num_experts = world * case.experts_per_rank
    recv_x, recv_w, tokens_per_expert, handle = reference.dispatch(
        group,
        x.to(dev),
        topk_idx.to(dev),
        None if weights is None else weights.to(dev),
        num_experts=num_experts,
        pad_multiple=case.pad_multiple,
        max_recv_tokens=case.max_recv_tokens,
    )
    ok = recv_x.device == tokens_per_expert.device == dev
    check("device", ok, f"{recv_x.device} / {tokens_per_expert.device}, expected {dev}")
    recv_x, tokens_per_expert = recv_x.cpu(), tokens_per_expert.cpu()
    recv_w = None if recv_w is None else recv_w.cpu()

    # --- dispatch: exact equality with the oracle layout --------------------------------------
    layouts = [_oracle_layout(case, inputs, dst, world) for dst in range(world)]
    exact_rows, exact_counts = layouts[rank]
    rows, counts = _fit(case, exact_rows, exact_counts)
    expected_x = torch.stack([r[0] for r in rows]) if rows else torch.zeros(0, case.hidden)
    expected_x = expected_x.to(case.dtype)
    ok = recv_x.dtype == x.dtype and torch.equal(recv_x, expected_x)
    check("recv_x", ok, f"\n{recv_x}\nexpected\n{expected_x}")
    if case.with_weights:
        expected_w = torch.tensor([r[1] for r in rows], dtype=torch.float32)
        ok = recv_w is not None and torch.equal(recv_w, expected_w)
        check("recv_weights", ok, f"{recv_w} expected {expected_w}")
    else:
        check("recv_weights", recv_w is None, "should be None")
    ok = tokens_per_expert.dtype == torch.int64 and tokens_per_expert.tolist() == counts
    check("tokens_per_expert", ok, f"{tokens_per_expert} expected {counts}")
    ok = handle.num_recv_rows == len(exact_rows)
    check("num_recv_rows", ok, f"{handle.num_recv_rows} expected {len(exact_rows)}")

    # --- combine: every rank's y, reduced per token in float64 --------------------------------
    gen = torch.Generator().manual_seed(1000 * case.seed + 500 + rank)
    # Padding / tail rows hold garbage on purpose: combine must ignore them.
    y = torch.randn(recv_x.shape, generator=gen).to(case.dtype)
    out = reference.combine(
        group, y.to(dev), handle, weights=None if recv_w is None else recv_w.to(dev)
    ).cpu()
    all_y = [None] * world
    dist.all_gather_object(all_y, y)

    expected_out = torch.zeros(x.shape[0], case.hidden, dtype=torch.float64)
    for dst in range(world):
        dst_rows, _ = _fit(case, *layouts[dst])
        for j, (_, w, owner) in enumerate(dst_rows):
            if owner is not None and owner[0] == rank:
                scale = w if case.with_weights else 1.0
                expected_out[owner[1]] += scale * all_y[dst][j].double()
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[case.dtype]
    ok = out.dtype == case.dtype and out.shape == expected_out.shape
    ok = ok and torch.allclose(out.double(), expected_out, rtol=tol, atol=tol)
    check("combine", ok, f"\n{out}\nexpected\n{expected_out}")
    if case.pad_multiple == 1:
        _check_token_rows(case, inputs, rank, world, dev, check)


def _rank_body(rank: int, world_size: int, device: str, cases: list[Case]) -> list[str]:
    """Run every case on this rank; return the failures seen here."""
    # The launcher has already made this rank's GPU the current device.
    dev = (
        torch.device("cuda", torch.cuda.current_device())
        if device == "cuda"
        else torch.device("cpu")
    )
    failures: list[str] = []
    for case in cases:
        _run_case(case, rank, world_size, dev, failures)
    # Out-of-range ids are refused on every rank before any collective starts.
    for bad in (-2, 2 * world_size):
        try:
            reference.dispatch(
                dist.group.WORLD,
                torch.zeros(1, 3, device=dev),
                torch.tensor([[bad]], device=dev),
                num_experts=2 * world_size,
            )
            failures.append(f"expert id {bad} was accepted")
        except ValueError:
            pass
    return failures


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_reference_matches_oracle(launch, device, world_size):
    failures = launch(_rank_body, world_size, device, CASES)
    messages = [f"rank {r}: {m}" for r, fs in enumerate(failures) for m in fs]
    assert not messages, "\n".join(messages)
