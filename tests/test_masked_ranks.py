"""Failed ranks in normal mode: W=4 ranks in one node or in 2 nodes of 2 (where MASKED is rank
0's rail peer: rows between rank 0 and rank 3 go straight over the network, and rank 0 forwards
for a masked source), rank MASKED masked by hand, or stopping (alive, no more
calls) or killed outright with ``mask_failed_ranks``, at a point of a round of calls (a dispatch
with a new layout, its combine, a cached dispatch along its handle, that one's combine). Every
live rank's outputs equal a reference computed here from every rank's inputs (each rank draws
them all), without MASKED's tokens and experts from the call it missed; the calls after the
failure take no timeout, and every live rank ends with MASKED, and only it, masked.

The reference, plain torch on the CPU: a dispatch's rows are, per local expert, the tokens that
name it, by source rank then token; a combine's expert outputs are their rows times a factor of
the expert (``_factor``), so that each token's sum is known from its own inputs; a cached
dispatch along a handle made while MASKED was live has zero rows where MASKED's would be.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch
import torch.distributed as dist
from conftest import DEVICE, assert_no_failures, raised, skip_if_a_killed_rank_shares_a_gpu

from hybrid_ep_triton import Buffer
from hybrid_ep_triton.tools.launcher import RankFailure, rank_device

WORLD, MASKED = 4, 2
HIDDEN, NUM_EXPERTS, LOCAL, TOPK, MAX_TOKENS = 65, 8, 2, 3, 12
HOT = MASKED * LOCAL + 1  # an expert on the masked rank that every other token names
# The live ranks' timeout_s where they mask the stalled rank themselves: well above the longest
# a live peer can keep them waiting (test_low_latency.STALL_TIMEOUT_S says why; on GPUs the
# kernels build in the first calls, before any rank stalls).
STALL_TIMEOUT_S = 25.0 if DEVICE == "cpu" else 45.0
CALLS = ("dispatch", "combine", "cached dispatch", "cached combine")  # a round
# Rounds where a rank fails: the failing call and at least the 20 calls after it.
ROUNDS = 6


def _inputs(round_: int, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s tokens [T, H] bf16, topk_idx [T, K] int64 (-1 slots, distinct ids, the
    hot expert) and weights [T, K] float32 of round ``round_``; T changes with the round and is
    0 on one rank in some rounds."""
    gen = torch.Generator().manual_seed(1000 * round_ + rank)
    tokens = [5, 12, 7, 0, 3, 9][(round_ + rank) % 6]
    x = torch.randn(tokens, HIDDEN, generator=gen).to(torch.bfloat16)
    idx = torch.rand(tokens, NUM_EXPERTS, generator=gen).argsort(1)[:, :TOPK]
    hot = torch.arange(tokens) % 2 == 0
    idx[hot, 0] = torch.where(idx[hot, 1:].eq(HOT).any(1), idx[hot, 0], HOT)
    idx[torch.rand(tokens, TOPK, generator=gen) < 0.2] = -1
    return x, idx, torch.rand(tokens, TOPK, generator=gen)


def _factor(expert: torch.Tensor) -> torch.Tensor:
    """The expert outputs here are the rows times a factor of their global expert."""
    return 1.0 + expert.float() / NUM_EXPERTS


def _expected_dispatch(inputs: list, rank: int, sources: list[int], zero_weights: int = -1):
    """(recv_x [N, H], recv_weights [N], tokens_per_expert [L]) of ``rank`` from the tokens of
    ``sources`` (the ranks in the layout); the weights of source ``zero_weights`` are 0."""
    rows, weights, counts = [], [], []
    for expert in range(rank * LOCAL, (rank + 1) * LOCAL):
        count = 0
        for src in sources:
            x, idx, w = inputs[src]
            hit = idx == expert
            tokens = hit.any(1).nonzero().flatten()
            rows.append(x[tokens])
            # (a token names an expert at most once: its weights come in token order)
            weights.append(w[hit] * (0 if src == zero_weights else 1))
            count += len(tokens)
        counts.append(count)
    return torch.cat(rows), torch.cat(weights), torch.tensor(counts)


def _expected_combine(inputs: list, rank: int, owners: list[int]) -> torch.Tensor:
    """Rank ``rank``'s combine [T, H] float32 of ``_expert_outputs``: each token's sum of
    weight * row * factor over its experts on ``owners``."""
    x, idx, w = inputs[rank]
    out = torch.zeros(x.shape, dtype=torch.float32)
    for k in range(TOPK):
        alive = (idx[:, k] >= 0) & torch.isin(idx[:, k] // LOCAL, torch.tensor(owners))
        y = (x.float() * _factor(idx[:, k])[:, None]).to(torch.bfloat16).float()
        out += torch.where(alive[:, None], w[:, k : k + 1] * y, 0.0)
    return out


def _check(fail, what: str, got: torch.Tensor, want: torch.Tensor, atol=0.0) -> None:
    """``got`` equals ``want`` within ``atol`` (a number, or a tensor of want's shape)."""
    if got.shape != want.shape:
        fail(f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}")
        return
    off = (got.float() - want.float()).abs() > atol
    off = off.any(1) if off.dim() > 1 else off
    if off.any():
        fail(f"{what}: rows {off.nonzero().flatten().tolist()} differ")


def _live_round(buf, rank: int, round_: int, stall_at: int, fail) -> None:
    """One round on a live rank; MASKED made the calls of index < ``stall_at`` (of all the
    rounds' calls, four a round)."""
    dev = rank_device()
    first = 4 * round_
    inputs = [_inputs(round_, j) for j in range(WORLD)]
    x, idx, w = inputs[rank]
    others = [j for j in range(WORLD) if j != MASKED]
    laid_out = list(range(WORLD)) if first < stall_at else others  # the layout's ranks
    recv_x, recv_w, per_expert, handle = buf.dispatch(x.to(dev), idx.to(dev), w.to(dev))
    want_x, want_w, want_counts = _expected_dispatch(inputs, rank, laid_out)
    _check(fail, f"round {round_} dispatch recv_x", recv_x.cpu(), want_x)
    _check(fail, f"round {round_} dispatch recv_weights", recv_w.cpu(), want_w)
    _check(fail, f"round {round_} tokens_per_expert", per_expert.cpu(), want_counts)
    _combine(buf, rank, inputs, recv_x, recv_w, handle, first + 1, laid_out, stall_at, fail)
    # New rows along the handle: MASKED's are zero where it has stopped since.
    cached = [(_new_rows(round_, j, len(t)), i, v) for j, (t, i, v) in enumerate(inputs)]
    _poison_free_memory(len(recv_x), dev)
    recv_x, recv_w, _, handle = buf.dispatch(
        cached[rank][0].to(dev), topk_weights=w.to(dev), handle=handle
    )
    gone = MASKED in laid_out and first + 2 >= stall_at
    shown = [(t * (0 if gone and j == MASKED else 1), i, v) for j, (t, i, v) in enumerate(cached)]
    want_x, want_w, _ = _expected_dispatch(
        shown, rank, laid_out, zero_weights=MASKED if gone else -1
    )
    _check(fail, f"round {round_} cached dispatch recv_x", recv_x.cpu(), want_x)
    _check(fail, f"round {round_} cached dispatch recv_weights", recv_w.cpu(), want_w)
    _combine(buf, rank, cached, recv_x, recv_w, handle, first + 3, laid_out, stall_at, fail)
    buf.check()


def _combine(buf, rank, inputs, recv_x, recv_w, handle, call, laid_out, stall_at, fail) -> None:
    """Call ``call``, a combine of ``_expert_outputs`` along ``handle``, against the reference:
    MASKED's experts add where it was in the layout and made this call."""
    out = buf.combine(_expert_outputs(recv_x, handle, rank), handle, weights=recv_w)
    owners = [j for j in laid_out if j != MASKED or call < stall_at]
    want = _expected_combine(inputs, rank, owners)
    scale = _expected_combine([(t.abs(), i, v) for t, i, v in inputs], rank, owners)
    # (bf16 rounding of the sum and of its rows' products)
    _check(fail, f"call {call} ({CALLS[call % 4]})", out.cpu(), want, atol=scale * 2e-2 + 1e-6)


def _expert_outputs(recv_x: torch.Tensor, handle, rank: int) -> torch.Tensor:
    """The experts' outputs of a dispatch's rows: each row times its expert's ``_factor``."""
    experts = torch.arange(rank * LOCAL, (rank + 1) * LOCAL, device=recv_x.device)
    per_row = torch.repeat_interleave(experts, handle.tokens_per_expert)
    return (recv_x.float() * _factor(per_row)[:, None]).to(torch.bfloat16)


def _poison_free_memory(rows: int, dev) -> None:
    """Free memory of an output's size that holds NaN, which the next call's outputs are likely
    to be given (torch.empty): rows a call fails to write then show, not zeros by chance."""
    for dtype in (torch.bfloat16, torch.float32):
        torch.full((max(rows, 1), HIDDEN), float("nan"), dtype=dtype, device=dev)
        torch.full((max(rows, 1),), float("nan"), dtype=dtype, device=dev)


def _new_rows(round_: int, rank: int, tokens: int) -> torch.Tensor:
    """The rows of a cached dispatch of rank ``rank`` in round ``round_``, [tokens, H] bf16."""
    gen = torch.Generator().manual_seed(1000 * round_ + rank + 500)
    return torch.randn(tokens, HIDDEN, generator=gen).to(torch.bfloat16)


def _body(
    rank: int, world: int, how: str, stall_at: int, rounds: int, ranks_per_node: int | None = None
) -> list[str]:
    """Rank MASKED makes the Buffer and the calls of index < ``stall_at``, then no more
    (``how``: "by hand": every live rank masks it; "told": rank 0 masks it, the others learn it
    from rank 0's first layout; "stalled": it stays alive; "killed": SIGKILL), while the live
    ranks run ``rounds`` rounds against the reference. "killed": a live rank raises its
    failures (the launcher reports only failed ranks once one has died)."""
    failures: list[str] = []

    def fail(msg: str) -> None:
        failures.append(f"[{how} at call {stall_at}] rank {rank}: {msg}")

    failing = how in ("stalled", "killed")
    buf = Buffer(
        None,
        hidden_size=HIDDEN,
        max_tokens_per_rank=MAX_TOKENS,
        num_experts=NUM_EXPERTS,
        device=rank_device(),
        mask_failed_ranks=failing,
        timeout_s=STALL_TIMEOUT_S if failing else 60.0,
        ranks_per_node=ranks_per_node,
    )
    try:
        if rank == MASKED:
            for round_ in range(-(-stall_at // 4)):
                _masked_round(buf, round_, stall_at)
            if how == "killed":
                os.kill(os.getpid(), signal.SIGKILL)
        else:
            if how == "by hand" or (how == "told" and rank == 0):
                buf.update_mask(MASKED)
            for round_ in range(rounds):
                _live_round(buf, rank, round_, stall_at, fail)
            if buf.masked_ranks != [MASKED]:
                fail(f"masked_ranks {buf.masked_ranks}, expected [{MASKED}]")
            mask = torch.full((world,), -1, dtype=torch.int32, device=rank_device())
            buf.query_mask(mask)
            if mask.tolist() != [int(j == MASKED) for j in range(world)]:
                fail(f"query_mask {mask.tolist()}")
    except Exception as e:
        fail(raised(e))
    finally:
        if how != "killed":
            dist.barrier()
        buf.destroy()
    if how == "killed" and failures:
        raise AssertionError("\n".join(failures))
    return failures


def _masked_round(buf, round_: int, stall_at: int) -> None:
    """The calls of a round that MASKED makes before it stops (it checks nothing)."""
    dev = rank_device()
    x, idx, w = _inputs(round_, MASKED)
    calls = range(4 * round_, min(4 * round_ + 4, stall_at))
    if 4 * round_ in calls:
        recv_x, recv_w, _, handle = buf.dispatch(x.to(dev), idx.to(dev), w.to(dev))
    if 4 * round_ + 1 in calls:
        buf.combine(_expert_outputs(recv_x, handle, MASKED), handle, weights=recv_w)
    if 4 * round_ + 2 in calls:
        rows = _new_rows(round_, MASKED, len(x))
        buf.dispatch(rows.to(dev), topk_weights=w.to(dev), handle=handle)


@pytest.mark.parametrize("ranks_per_node", [None, 2], ids=["one node", "2x2"])
def test_masked_rank_is_skipped(launch, ranks_per_node):
    """A rank masked by hand (on rank 0, which tells the others in its first layout) is a
    source and destination of nothing, in every call, and nobody waits for it."""
    assert_no_failures(launch(_body, WORLD, "told", 0, 1, ranks_per_node))


@pytest.mark.slow
@pytest.mark.parametrize("ranks_per_node", [None, 2], ids=["one node", "2x2"])
@pytest.mark.parametrize("stall_at", [0, 2], ids=["before a dispatch", "before a cached dispatch"])
def test_rank_that_stops_answering_is_masked(launch, stall_at, ranks_per_node):
    """mask_failed_ranks: the live ranks' waits on the stalled rank run out and mask it; that
    call and the rounds after it equal the reference without it (between a dispatch and its
    combine: test_rank_killed_outright_is_masked)."""
    assert_no_failures(launch(_body, WORLD, "stalled", stall_at, ROUNDS, ranks_per_node))


@pytest.mark.slow
@pytest.mark.parametrize("ranks_per_node", [None, 2], ids=["one node", "2x2"])
def test_rank_killed_outright_is_masked(launch, ranks_per_node):
    """The same with the rank's process killed (SIGKILL) between its dispatch and its combine:
    the only failure the launcher reports is that rank's death."""
    skip_if_a_killed_rank_shares_a_gpu(WORLD)
    with pytest.raises(RankFailure) as failed:
        launch(_body, WORLD, "killed", 1, ROUNDS, ranks_per_node, fresh=True, failure_grace_s=300)
    assert list(failed.value.failures) == [MASKED], failed.value.failures
