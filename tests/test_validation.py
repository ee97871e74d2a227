"""Input validation of ``Buffer``: bad input raises ValueError, and the Buffer stays usable.

Shape / dtype / parameter errors are detected locally before any launch, so every rank makes
the same bad call (all ranks raise, and they stay in lock-step); the test checks on every rank
that the call raised ValueError, that nothing moved (the Buffer's control words and this rank's
symmetric heap are unchanged), and at the end that a correct dispatch + combine still matches
``hybrid_ep_triton.reference``. Routing VALUE errors (ids out of range, duplicates) are found on
the device during the collective layout step: only one rank passes bad ids, and every rank
must raise ValueError, the bad rank naming its first bad row and the others naming the bad rank.
A Buffer on CPU ranks without Triton's interpreter raises ValueError saying to turn it on.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from conftest import assert_no_failures

from hybrid_ep_triton import Buffer, reference
from hybrid_ep_triton.buffer import ranks_per_host
from hybrid_ep_triton.moe import TokenDispatcher
from hybrid_ep_triton.tools.launcher import rank_device

BF16 = torch.bfloat16
TOL = {torch.bfloat16: 2e-2, torch.float16: 2e-3, torch.float32: 1e-5}


def _inputs(seed: int, num_tokens: int, hidden: int, num_experts: int, topk: int, dtype):
    """x [T, H], topk_idx [T, K] int64 (distinct ids, some -1), weights [T, K] on the device."""
    gen = torch.Generator().manual_seed(seed)
    dev = rank_device()
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    idx = torch.rand(num_tokens, num_experts, generator=gen).topk(topk, dim=1).indices
    idx[torch.rand(num_tokens, topk, generator=gen) < 0.2] = -1
    w = torch.rand(num_tokens, topk, generator=gen)
    return x.to(dev), idx.to(dev), w.to(dev)


def _check_round_trip(buf: Buffer, seed: int, num_tokens: int, topk: int, what: str, **kw):
    """A correct dispatch + combine on ``buf`` matches the reference; returns failure strings."""
    failures = []
    rank = dist.get_rank()
    x, idx, w = _inputs(seed, num_tokens, buf.hidden_size, buf.num_experts, topk, buf.dtype)
    got = buf.dispatch(x, idx, w, **kw)
    want = reference.dispatch(None, x, idx, w, num_experts=buf.num_experts, **kw)
    for name, a, b in zip(
        ("recv_x", "recv_weights", "tokens_per_expert"), got[:3], want[:3], strict=True
    ):
        if a.dtype != b.dtype or not torch.equal(a, b):
            failures.append(f"rank {rank}, {what}: dispatch {name} differs from the reference")
    y = torch.randn(got[0].shape, generator=torch.Generator().manual_seed(seed + 1))
    y = y.to(buf.dtype).to(x.device)
    out = buf.combine(y, got[3], weights=got[1])
    ref = reference.combine(None, y, want[3], weights=want[1])
    tol = TOL[buf.dtype]
    if out.dtype != ref.dtype or not torch.allclose(out.float(), ref.float(), atol=tol, rtol=tol):
        err = (out.float() - ref.float()).abs().max().item() if out.shape == ref.shape else None
        failures.append(f"rank {rank}, {what}: combine differs from the reference (max err {err})")
    return failures


def _expect_value_error(failures: list, what: str, call, match: str | None = None) -> None:
    try:
        call()
    except ValueError as e:
        if match is not None and match not in str(e):
            failures.append(f"{what}: ValueError {str(e)!r} does not mention {match!r}")
    except Exception as e:
        failures.append(f"{what}: raised {e!r}, expected ValueError")
    else:
        failures.append(f"{what}: did not raise ValueError")


# --- bad tensors and arguments of dispatch / combine ----------------------------------------

H, T_MAX, E, K = 5, 6, 4, 2  # W=2: 2 experts per rank


def _bad_call_body(rank: int, world_size: int) -> list[str]:
    failures: list[str] = []
    dev = rank_device()
    buf = Buffer(
        None, hidden_size=H, max_tokens_per_rank=T_MAX, num_experts=E, dtype=BF16, device=dev
    )
    rt = buf._rt  # internals, only to prove that a refused call moved nothing

    def refused(what: str, call, match: str | None = None) -> None:
        """A call that every rank's host refuses before it launches anything: the heap and
        control words are unchanged."""
        if dev.type == "cuda":  # this rank's earlier launches are done (they are asynchronous)
            torch.cuda.synchronize()
        dist.barrier()  # ... and every peer's: none is still writing into our heap
        control, heap = rt.control.clone(), rt.heap.local.clone()
        _expect_value_error(failures, f"rank {rank}: {what}", call, match)
        if not torch.equal(rt.control, control):
            failures.append(f"rank {rank}: {what}: control words {control} -> {rt.control}")
        if not torch.equal(rt.heap.local, heap):
            changed = (rt.heap.local != heap).nonzero().flatten()
            regions = {n: o for n, o in vars(rt.plan.heap).items() if n != "total_bytes"}
            first = int(changed[0])
            region = max((o, n) for n, o in regions.items() if o <= first)[1]
            failures.append(
                f"rank {rank}: {what}: the symmetric heap changed ({len(changed)} bytes, the "
                f"first at {first}, in {region})"
            )
        # A peer's next call may be a layout exchange, which writes its flag into this rank's
        # heap, and a faster peer would make it before this rank has compared: the barrier
        # holds every rank until all have.
        dist.barrier()

    def refused_by_all(what: str, call, match: str | None = None) -> None:
        """A call whose input every rank's host refuses, and each raises its own: the ranks
        still make a new-layout dispatch's layout exchange, to learn whether any peer refused
        (test_a_bad_input_on_one_rank_is_an_error_on_every_rank), and run a call along a
        handle with zero rows (test_a_bad_call_along_a_handle_on_one_rank_...)."""
        _expect_value_error(failures, f"rank {rank}: {what}", call, match)

    x, idx, w = _inputs(100 + rank, 4, H, E, K, BF16)
    z = dict(device=dev)
    refused_by_all("x with the wrong hidden size", lambda: buf.dispatch(x[:, :4], idx, w), "x must")
    refused_by_all("1-D x", lambda: buf.dispatch(x.flatten(), idx, w), "x must")
    refused_by_all("x as a list", lambda: buf.dispatch(x.tolist(), idx, w), "x must")
    refused_by_all("x float32", lambda: buf.dispatch(x.float(), idx, w), "x must be torch.bfloat16")
    refused_by_all(
        f"FP8 rows at hidden {H}", lambda: buf.dispatch((x, x), idx, w), "multiple of 128"
    )
    refused_by_all(
        f"quantize at hidden {H}", lambda: buf.dispatch(x, idx, w, quantize=True), "multiple of 128"
    )
    big = torch.zeros(T_MAX + 1, H, dtype=BF16, **z)
    big_idx = torch.zeros(T_MAX + 1, K, dtype=torch.int64, **z)
    refused_by_all("too many tokens", lambda: buf.dispatch(big, big_idx), "max_tokens_per_rank")
    cols = torch.zeros(H, 4, dtype=BF16, **z).t()  # [4, H] with stride(1) != 1
    refused_by_all("x with non-contiguous rows", lambda: buf.dispatch(cols, idx, w), "contiguous")
    refused_by_all("topk_idx float", lambda: buf.dispatch(x, idx.float(), w), "int32 or int64")
    refused_by_all(
        "topk_idx int16", lambda: buf.dispatch(x, idx.to(torch.int16), w), "int32 or int64"
    )
    refused_by_all(
        "topk_idx with a row too many", lambda: buf.dispatch(x, torch.cat([idx, idx[:1]]))
    )
    refused_by_all("1-D topk_idx", lambda: buf.dispatch(x, idx[:, 0], None), "topk_idx")
    refused_by_all("topk_idx with K=0", lambda: buf.dispatch(x, idx[:, :0], None), "K >= 1")
    refused_by_all("no topk_idx and no handle", lambda: buf.dispatch(x), "topk_idx")
    refused_by_all(
        "topk_weights [T, K+1]", lambda: buf.dispatch(x, idx, torch.cat([w, w[:, :1]], 1))
    )
    refused_by_all("topk_weights [T+1, K]", lambda: buf.dispatch(x, idx, torch.cat([w, w[:1]])))
    refused_by_all("topk_weights float64", lambda: buf.dispatch(x, idx, w.double()), "float32")
    refused_by_all("topk_weights bf16", lambda: buf.dispatch(x, idx, w.to(BF16)), "float32")
    refused_by_all(
        "pad_multiple 0", lambda: buf.dispatch(x, idx, w, pad_multiple=0), "pad_multiple"
    )
    refused_by_all("pad_multiple 2.0", lambda: buf.dispatch(x, idx, w, pad_multiple=2.0))
    refused_by_all("max_recv_tokens -1", lambda: buf.dispatch(x, idx, w, max_recv_tokens=-1))
    refused("handle of another type", lambda: buf.dispatch(x, handle=object()), "handle")
    refused_by_all(
        "previous_event of another type", lambda: buf.dispatch(x, idx, previous_event=object())
    )
    stats = torch.zeros(E // world_size, dtype=torch.int64, **z)
    for what, bad in (
        ("int32", stats.int()),
        ("[L + 1]", torch.zeros(E // world_size + 1, **z)),
        ("a list", stats.tolist()),
    ):
        refused_by_all(
            f"expert_recv_stats {what}",
            lambda bad=bad: buf.dispatch(x, idx, w, expert_recv_stats=bad),
            "expert_recv_stats",
        )

    # A correct dispatch gives a handle for the bad cached dispatches and combines. Each rank
    # still runs a refused call along a handle, with zero rows, so that no peer waits for it;
    # its next dispatch with a new layout tells every rank of the first such refusal.
    failures += _check_round_trip(buf, 200 + rank, 3 + rank, K, "dispatch between bad calls")
    rx, rw, _, h = buf.dispatch(x, idx, w)
    n = rx.shape[0]
    y = torch.randn(n, H).to(BF16).to(dev)
    refused_by_all(
        "cached dispatch with fewer tokens", lambda: buf.dispatch(x[:3], handle=h), "handle"
    )
    w_wide = torch.cat([w, w[:, :1]], 1)
    refused_by_all(
        "cached dispatch, weights [T, K+1]", lambda: buf.dispatch(x, None, w_wide, handle=h)
    )
    cached_counted = lambda: buf.dispatch(x, handle=h, expert_recv_stats=stats)  # noqa: E731
    refused_by_all("cached dispatch with expert_recv_stats", cached_counted, "without a handle")
    if stats.any():
        failures.append(f"rank {rank}: refused calls added into expert_recv_stats: {stats}")
    refused_by_all("y with a row too many", lambda: buf.combine(torch.cat([y, y[:1]]), h), "y must")
    refused_by_all("y with the wrong hidden size", lambda: buf.combine(y[:, :4], h), "y must")
    refused_by_all("y float32", lambda: buf.combine(y.float(), h), "y must be torch.bfloat16")
    refused_by_all("1-D y", lambda: buf.combine(y.flatten(), h), "y must")
    y_cols = torch.zeros(H, n, dtype=BF16, **z).t()
    refused_by_all("y with non-contiguous rows", lambda: buf.combine(y_cols, h), "contiguous")
    refused_by_all(
        "weights [N+1]", lambda: buf.combine(y, h, weights=torch.zeros(n + 1, **z)), "weights"
    )
    refused_by_all("weights [N, 1]", lambda: buf.combine(y, h, weights=rw[:, None]), "weights")
    refused_by_all("weights bf16", lambda: buf.combine(y, h, weights=rw.to(BF16)), "weights")
    refused("combine without a handle", lambda: buf.combine(y, None), "handle")
    refused_by_all("combine, previous_event a tensor", lambda: buf.combine(y, h, previous_event=y))
    refused_by_all(
        "combine's topk_weights with expert-major rows",
        lambda: buf.combine(y, h, topk_weights=torch.zeros(n, K, **z)),
        "token rows",
    )
    _expect_value_error(
        failures,
        f"rank {rank}: an expert-major handle's recv_src_idx",
        lambda: h.recv_src_idx,
        "token row",
    )

    # Still usable: the pending handle; the next new-layout dispatch tells of the first refusal
    # along a handle, on every rank, and moves nothing; then fresh calls in both modes.
    out = buf.combine(y, h, weights=rw)
    if out.shape != (4, H):
        failures.append(f"rank {rank}: combine after the bad calls returned {tuple(out.shape)}")
    _expect_value_error(
        failures,
        f"rank {rank}: the dispatch after refusals along a handle",
        lambda: buf.dispatch(x, idx, w),
        "(this rank) refused its cached dispatch's handle",
    )
    failures += _check_round_trip(buf, 300 + rank, 5 - rank, K, "after the bad calls")
    failures += _check_round_trip(
        buf, 400 + rank, T_MAX, K, "after the bad calls, max mode", max_recv_tokens=30
    )
    buf.destroy()
    try:
        buf.dispatch(x, idx, w)
        failures.append(f"rank {rank}: dispatch on a destroyed Buffer did not raise")
    except RuntimeError as e:
        if "destroyed" not in str(e):
            failures.append(f"rank {rank}: dispatch after destroy: unclear message {e}")
    return failures


def test_bad_dispatch_and_combine_arguments(launch):
    results = launch(_bad_call_body, 2)
    assert_no_failures(results)


# --- a bad input on one rank ------------------------------------------------------------------
#
# Rank BAD of the group passes one bad argument to a new-layout dispatch, the others good ones:
# every rank raises ValueError in that call (the bad rank its own message, the others naming
# the bad rank and the argument; not a TimeoutError, which would also leave the Buffer
# unusable), in exact and max_recv_tokens mode, and the next call succeeds on every rank.


def _bad_input(kind: str, x, idx, w):
    """(dispatch's arguments with the ``kind`` of bad input, the refused argument, what the bad
    rank's own ValueError mentions)."""
    z = dict(device=x.device)
    bad = {
        "x float32": (dict(x=x.float()), "x", "x must be torch.bfloat16"),
        "x [T, H-1]": (dict(x=x[:, :-1]), "x", "x must"),
        "x of too many tokens": (
            dict(
                x=torch.zeros(T_MAX + 1, H, dtype=BF16, **z),
                topk_idx=torch.zeros(T_MAX + 1, K, dtype=torch.int64, **z),
            ),
            "x",
            "max_tokens_per_rank",
        ),
        "x with non-contiguous rows": (
            dict(x=torch.zeros(H, x.shape[0], dtype=BF16, **z).t()),
            "x",
            "contiguous",
        ),
        "quantize at a hidden size not a multiple of 128": (
            dict(quantize=True),
            "quantize",
            "multiple of 128",
        ),
        "topk_idx float": (dict(topk_idx=idx.float()), "topk_idx", "int32 or int64"),
        "topk_idx with a row too many": (
            dict(topk_idx=torch.cat([idx, idx[:1]])),
            "topk_idx",
            "topk_idx",
        ),
        "topk_weights bf16": (dict(topk_weights=w.to(BF16)), "topk_weights", "float32"),
        "pad_multiple 0": (dict(pad_multiple=0), "pad_multiple", "pad_multiple"),
        "max_recv_tokens -1": (dict(max_recv_tokens=-1), "max_recv_tokens", "max_recv_tokens"),
        "expert_recv_stats int32": (
            dict(expert_recv_stats=torch.zeros(E // 2, dtype=torch.int32, **z)),
            "expert_recv_stats",
            "expert_recv_stats",
        ),
    }
    return bad[kind]


def _one_bad_rank_body(rank: int, world_size: int, kinds: list[str]) -> list[str]:
    failures: list[str] = []
    bad_rank = world_size - 1
    buf = Buffer(
        None,
        hidden_size=H,
        max_tokens_per_rank=T_MAX,
        num_experts=E * world_size // 2,
        dtype=BF16,
        timeout_s=120,
        device=rank_device(),
    )
    for i, kind in enumerate(kinds):
        for mode in (None, 40):
            what = f"rank {rank}, {kind} on rank {bad_rank}, max_recv_tokens={mode}"
            x, idx, w = _inputs(10 * i + rank, 3 + rank % 2, H, buf.num_experts, K, BF16)
            args = dict(x=x, topk_idx=idx, topk_weights=w, max_recv_tokens=mode)
            if rank == bad_rank:
                change, argument, match = _bad_input(kind, x, idx, w)
                args.update(change)
            else:
                argument = _bad_input(kind, x, idx, w)[1]
                match = f"rank {bad_rank} refused its {argument}"
            # max_recv_tokens mode on GPUs: a peer's refusal is raised by check(), as invalid
            # routing is (CPU ranks raise it in the call).
            call = lambda args=args: buf.check(buf.dispatch(**args)[-1])  # noqa: E731
            _expect_value_error(failures, what, call, match)
            failures += _check_round_trip(
                buf, 500 + 10 * i + rank, 2 + rank, K, f"{what}: the next call"
            )
    buf.destroy()
    return failures


@pytest.mark.parametrize("world", [2, 4])
def test_a_bad_input_on_one_rank_is_an_error_on_every_rank(launch, world):
    kinds = [
        "x float32",
        "x [T, H-1]",
        "x of too many tokens",
        "x with non-contiguous rows",
        "quantize at a hidden size not a multiple of 128",
        "topk_idx float",
        "topk_idx with a row too many",
        "topk_weights bf16",
        "pad_multiple 0",
        "max_recv_tokens -1",
        "expert_recv_stats int32",
    ]
    if world == 4:  # one of each argument
        kinds = [
            "x float32",
            "topk_idx float",
            "topk_weights bf16",
            "pad_multiple 0",
            "max_recv_tokens -1",
            "expert_recv_stats int32",
        ]
    results = launch(_one_bad_rank_body, world, kinds)
    assert_no_failures(results)


# Rank BAD passes one bad argument to a call along a handle (a cached dispatch or a combine), the
# others good ones: the bad rank raises its ValueError at once and still runs the call with zero
# rows, so its peers' calls return (no peer waits out timeout_s), their outputs not valid; the
# next dispatch with a new layout is a ValueError on every rank, naming the bad rank and the
# argument, and moves nothing (in exact and max_recv_tokens mode); the one after succeeds.


def _bad_call_along_a_handle(kind: str, x, w, y, rw):
    """(the bad call's arguments: a cached dispatch's x / topk_weights / ..., or a combine's y /
    weights / ...; the refused argument as the peers hear of it; what the bad rank's own
    ValueError mentions)."""
    z = dict(device=x.device)
    bad = {
        "cached dispatch, x float32": (dict(x=x.float()), "cached dispatch's x", "x must"),
        "cached dispatch, x of a token too few": (
            dict(x=x[1:]),
            "cached dispatch's handle",
            "the handle's",
        ),
        "cached dispatch, topk_weights [T, K+1]": (
            dict(topk_weights=torch.cat([w, w[:, :1]], 1)),
            "cached dispatch's topk_weights",
            "topk_weights",
        ),
        "cached dispatch, expert_recv_stats": (
            dict(expert_recv_stats=torch.zeros(E // 2, dtype=torch.int64, **z)),
            "cached dispatch's expert_recv_stats",
            "without a handle",
        ),
        "cached dispatch, previous_event a tensor": (
            dict(previous_event=x),
            "cached dispatch's previous_event",
            "previous_event",
        ),
        "combine, y float32": (dict(y=y.float()), "combine's y", "y must"),
        "combine, y with a row too many": (dict(y=torch.cat([y, y[:1]])), "combine's y", "y must"),
        "combine, weights bf16": (dict(weights=rw.to(BF16)), "combine's weights", "weights"),
        "combine, previous_event a tensor": (
            dict(previous_event=y),
            "combine's previous_event",
            "previous_event",
        ),
    }
    return bad[kind]


def _buffer_of_two_experts_a_rank(world_size: int, ranks_per_node: int | None, **kw) -> Buffer:
    return Buffer(
        None,
        hidden_size=H,
        max_tokens_per_rank=T_MAX,
        num_experts=E * world_size // 2,
        dtype=BF16,
        timeout_s=120,
        ranks_per_node=ranks_per_node,
        device=rank_device(),
        **kw,
    )


def _one_bad_call_along_a_handle_body(
    rank: int, world_size: int, ranks_per_node: int | None, kinds: list[str]
) -> list[str]:
    failures: list[str] = []
    bad_rank = world_size - 1
    buf = _buffer_of_two_experts_a_rank(world_size, ranks_per_node)
    for i, kind in enumerate(kinds):
        handle_mode = (None, 40)[i % 2]  # the handle's dispatch
        x, idx, w = _inputs(20 * i + rank, 3 + rank % 2, H, buf.num_experts, K, BF16)
        rx, rw, _, h = buf.dispatch(x, idx, w, max_recv_tokens=handle_mode)
        y = torch.randn(rx.shape, generator=torch.Generator().manual_seed(i)).to(BF16)
        y = y.to(x.device)
        args = dict(x=x, topk_weights=w) if kind.startswith("cached") else dict(y=y, weights=rw)
        change, argument, match = _bad_call_along_a_handle(kind, x, w, y, rw)
        call = buf.dispatch if kind.startswith("cached") else buf.combine
        what = f"rank {rank}, {kind} on rank {bad_rank}"
        if rank == bad_rank:
            bad_args = {**args, **change, "handle": h}
            _expect_value_error(failures, what, lambda a=bad_args, c=call: c(**a), match)
        else:  # returns: its outputs are not valid, which the next dispatch says
            call(**args, handle=h)
        for mode in (None, 40):
            seed = 20 * i + 10 + rank
            if mode is None:  # told once, by the first new-layout dispatch (exact mode)
                told = f"rank {bad_rank} refused its {argument} in an earlier call along a handle"
                if rank == bad_rank:
                    told = f"rank {bad_rank} (this rank) refused its {argument}"
                next_args = _inputs(seed, 2 + rank % 3, H, buf.num_experts, K, BF16)
                _expect_value_error(
                    failures,
                    f"{what}: the next dispatch",
                    lambda a=next_args: buf.dispatch(*a),
                    told,
                )
            failures += _check_round_trip(
                buf, seed + 5, 2 + rank, K, f"{what}: the dispatch after it", max_recv_tokens=mode
            )
    buf.destroy()
    return failures


@pytest.mark.parametrize("world, ranks_per_node", [(2, None), (4, 2)], ids=["W2", "W4-2x2"])
def test_a_bad_call_along_a_handle_on_one_rank_is_an_error_on_every_rank(
    launch, world, ranks_per_node
):
    kinds = [
        "cached dispatch, x float32",
        "combine, y float32",
        "cached dispatch, x of a token too few",
        "combine, weights bf16",
        "cached dispatch, topk_weights [T, K+1]",
        "combine, y with a row too many",
        "cached dispatch, expert_recv_stats",
        "combine, previous_event a tensor",
        "cached dispatch, previous_event a tensor",
    ]
    if world == 4:  # across 2 nodes: one of each call
        kinds = ["cached dispatch, x float32", "combine, weights bf16"]
    results = launch(_one_bad_call_along_a_handle_body, world, ranks_per_node, kinds)
    assert_no_failures(results)


# An adapter's own check failing on rank BAD (Buffer.refuse), the others making the call: the
# bad rank raises its own error, a new-layout dispatch raises on every rank naming the bad rank
# and the argument, a call along a handle tells them at the next new-layout dispatch, as a
# refused native input does; and token rows' combine refuses topk_weights of another shape.


def _adapter_refusal_body(rank: int, world_size: int) -> list[str]:
    failures: list[str] = []
    bad_rank = world_size - 1
    buf = _buffer_of_two_experts_a_rank(world_size, None, expand=False)
    own = ValueError("the adapter's own check failed")
    for i, mode in enumerate((None, 40)):
        what = f"rank {rank}, a refused dispatch on rank {bad_rank}, max_recv_tokens={mode}"
        x, idx, w = _inputs(30 * i + rank, 3 + rank % 2, H, buf.num_experts, K, BF16)
        if rank == bad_rank:
            call = lambda m=mode: buf.refuse("dispatch", "topk_idx", own, max_recv_tokens=m)  # noqa: E731
            match = str(own)
        else:
            call = lambda a=(x, idx, w), m=mode: buf.check(buf.dispatch(*a, max_recv_tokens=m)[-1])  # noqa: E731
            match = f"rank {bad_rank} refused its topk_idx"
        _expect_value_error(failures, what, call, match)
        failures += _check_token_round_trip(buf, 40 + 10 * i + rank, what)
    x, idx, w = _inputs(90 + rank, 4, H, buf.num_experts, K, BF16)
    rx, _, rw, _, h = buf.dispatch(x, idx, w)
    y = torch.randn(rx.shape, generator=torch.Generator().manual_seed(rank)).to(BF16).to(x.device)
    what = f"rank {rank}, combine's topk_weights [N, K+1] on rank {bad_rank}"
    if rank == bad_rank:
        wide = torch.cat([rw, rw[:, :1]], 1)
        _expect_value_error(
            failures, what, lambda: buf.combine(y, h, topk_weights=wide), "topk_weights"
        )
    else:
        buf.combine(y, h, topk_weights=rw)
    told = f"rank {bad_rank} refused its combine's topk_weights in an earlier call along a handle"
    if rank == bad_rank:
        told = f"rank {bad_rank} (this rank) refused its combine's topk_weights"
    _expect_value_error(
        failures, f"{what}: the next dispatch", lambda: buf.dispatch(x, idx, w), told
    )
    failures += _check_token_round_trip(buf, 95 + rank, f"{what}: the dispatch after it")
    buf.destroy()
    return failures


def _check_token_round_trip(buf: Buffer, seed: int, what: str) -> list[str]:
    """A correct token-row dispatch + combine with topk_weights matches the reference."""
    rank = dist.get_rank()
    x, idx, w = _inputs(seed, 2 + rank, buf.hidden_size, buf.num_experts, K, buf.dtype)
    rx, ridx, rw, _, h = buf.dispatch(x, idx, w)
    want = reference.dispatch(None, x, idx, w, num_experts=buf.num_experts, expand=False)
    if not (torch.equal(rx, want[0]) and torch.equal(ridx, want[1]) and torch.equal(rw, want[2])):
        return [f"rank {rank}, {what}: token rows differ from the reference"]
    y = torch.randn(rx.shape, generator=torch.Generator().manual_seed(seed)).to(buf.dtype)
    out, summed = buf.combine(y.to(x.device), h, topk_weights=rw)
    ref_out, ref_summed = reference.combine(None, y.to(x.device), want[-1], topk_weights=want[2])
    tol = TOL[buf.dtype]
    if not torch.allclose(out.float(), ref_out.float(), atol=tol, rtol=tol) or not torch.allclose(
        summed, ref_summed, atol=1e-6, rtol=1e-6
    ):
        return [f"rank {rank}, {what}: combine differs from the reference"]
    return []


def test_an_adapters_refusal_on_one_rank_is_an_error_on_every_rank(launch):
    results = launch(_adapter_refusal_body, 2)
    assert_no_failures(results)


# Buffer(agree_on_inputs=True): every call first agrees on the host, so a bad input of rank BAD
# in any call (along a handle, with a new layout, a handle not of this Buffer) is a ValueError
# on every rank of that very call, and nothing moves: the same call along the same handle then
# goes ahead and matches the reference, and so does a new round trip.


def _agreeing_body(
    rank: int, world_size: int, ranks_per_node: int | None, kinds: list[str]
) -> list[str]:
    failures: list[str] = []
    bad_rank = world_size - 1
    buf = _buffer_of_two_experts_a_rank(world_size, ranks_per_node, agree_on_inputs=True)
    for i, kind in enumerate(kinds):
        mode = (None, 40)[i % 2]
        x, idx, w = _inputs(20 * i + rank, 3 + rank % 2, H, buf.num_experts, K, BF16)
        rx, rw, _, h = buf.dispatch(x, idx, w, max_recv_tokens=mode)
        want = reference.dispatch(
            None, x, idx, w, num_experts=buf.num_experts, max_recv_tokens=mode
        )
        y = torch.randn(rx.shape, generator=torch.Generator().manual_seed(i)).to(BF16)
        y = y.to(x.device)
        if kind == "dispatch, x float32":
            call, args, change = buf.dispatch, dict(x=x, topk_idx=idx), dict(x=x.float())
            argument, match = "dispatch's x", "x must"
        elif kind == "combine, a handle of another Buffer":
            call, args, change = buf.combine, dict(y=y, handle=h), dict(handle="h")
            argument, match = "combine's handle", "handle must be a DispatchHandle"
        else:
            cached = kind.startswith("cached")
            call = buf.dispatch if cached else buf.combine
            args = dict(x=x, topk_weights=w) if cached else dict(y=y, weights=rw)
            args["handle"] = h
            change, argument, match = _bad_call_along_a_handle(kind, x, w, y, rw)
        told = match if rank == bad_rank else f"rank {bad_rank} refused its {argument}: "
        bad_args = {**args, **change} if rank == bad_rank else args
        what = f"rank {rank}, {kind} on rank {bad_rank}"
        _expect_value_error(failures, what, lambda c=call, a=bad_args: c(**a), told)
        # Nothing moved: the handle serves on, its dispatch's rows and sums as the reference's.
        again = buf.dispatch(x, topk_weights=w, handle=h)
        if not (torch.equal(again[0], want[0]) and torch.equal(again[1], want[1])):
            failures.append(f"{what}: the cached dispatch after it differs from the reference")
        out = buf.combine(y, h, weights=rw)
        ref = reference.combine(None, y, want[3], weights=want[1])
        if not torch.allclose(out.float(), ref.float(), atol=TOL[BF16], rtol=TOL[BF16]):
            failures.append(f"{what}: the combine after it differs from the reference")
        after = f"{what}: the dispatch after it"
        failures += _check_round_trip(
            buf, 20 * i + 15 + rank, 2 + rank, K, after, max_recv_tokens=mode
        )
    buf.destroy()
    return failures


@pytest.mark.parametrize("world, ranks_per_node", [(2, None), (4, 2)], ids=["W2", "W4-2x2"])
def test_agreeing_ranks_raise_a_bad_input_in_the_call_on_every_rank(launch, world, ranks_per_node):
    kinds = [
        "cached dispatch, x float32",
        "combine, y float32",
        "cached dispatch, x of a token too few",
        "combine, weights bf16",
        "cached dispatch, topk_weights [T, K+1]",
        "combine, y with a row too many",
        "cached dispatch, expert_recv_stats",
        "combine, previous_event a tensor",
        "cached dispatch, previous_event a tensor",
        "dispatch, x float32",
        "combine, a handle of another Buffer",
    ]
    if world == 4:  # across 2 nodes
        kinds = ["cached dispatch, x float32", "combine, weights bf16", "dispatch, x float32"]
    results = launch(_agreeing_body, world, ranks_per_node, kinds)
    assert_no_failures(results)


# --- constructor -----------------------------------------------------------------------------


def _constructor_body(rank: int, world_size: int) -> list[str]:
    failures: list[str] = []
    good = dict(
        hidden_size=8, max_tokens_per_rank=4, num_experts=4, dtype=BF16, device=rank_device()
    )
    same_bad = [
        ("hidden_size 0", dict(hidden_size=0), "hidden_size"),
        ("hidden_size -3", dict(hidden_size=-3), "hidden_size"),
        ("hidden_size True", dict(hidden_size=True), "hidden_size"),
        ("max_tokens_per_rank -1", dict(max_tokens_per_rank=-1), "max_tokens_per_rank"),
        ("num_experts 0", dict(num_experts=0), "num_experts"),
        ("num_experts 3 with 2 ranks", dict(num_experts=3), "divisible"),
        ("dtype int8", dict(dtype=torch.int8), "dtype"),
        ("dtype float64", dict(dtype=torch.float64), "dtype"),
        ("num_sms 0", dict(num_sms=0), "num_sms"),
        ("num_sms 133", dict(num_sms=133), "num_sms"),
        ("timeout_s 0", dict(timeout_s=0), "timeout_s"),
        ("low_latency_tokens 65536", dict(low_latency_tokens=65536), "low_latency_tokens"),
        ("expand 1", dict(expand=1), "expand"),
        ("agree_on_inputs None", dict(agree_on_inputs=None), "agree_on_inputs"),
        ("ranks_per_node 0", dict(ranks_per_node=0), "ranks_per_node"),
        ("ranks_per_node 3 of 2 ranks", dict(ranks_per_node=3), "ranks_per_node"),
        ("device meta", dict(device="meta"), "device"),
        ("device 'gpu'", dict(device="gpu"), "device"),
    ]
    dev = good["device"]
    if not torch.cuda.is_available():
        same_bad.append(("a CUDA device without one", dict(device="cuda"), "no CUDA device"))
    if dev.type == "cuda":
        other = f"cuda:{dev.index + 1}"
        same_bad.append(("another process's GPU", dict(device=other), "not this process's"))
        context_sms = torch.cuda.get_device_properties(dev).multi_processor_count
        if context_sms < 132:  # a share of the GPU (MPS)
            too_many = dict(num_sms=context_sms + 1)
            same_bad.append(("num_sms above the context's SMs", too_many, "SMs this process's"))
    if dist.get_backend() == "nccl":
        same_bad.append(("the CPU with an NCCL group", dict(device="cpu"), "NCCL"))
    for what, change, match in same_bad:
        kw = {**good, **change}
        _expect_value_error(
            failures, f"rank {rank}: {what}", lambda kw=kw: Buffer(None, **kw), match
        )
    # A bad parameter on the last rank only: every rank raises, the others naming that rank.
    for what, change, match in same_bad[::3]:
        bad_here = rank == world_size - 1
        kw = {**good, **change} if bad_here else good
        reason = match if bad_here else f"rank {world_size - 1} refused the Buffer's parameters"
        _expect_value_error(
            failures,
            f"rank {rank}: {what} on the last rank",
            lambda kw=kw: Buffer(None, **kw),
            reason,
        )
    # Parameters that differ between ranks: every rank raises, naming the parameter.
    differing = [
        ("hidden_size", dict(hidden_size=8 + rank)),
        ("max_tokens_per_rank", dict(max_tokens_per_rank=4 + rank)),
        ("num_experts", dict(num_experts=4 * (1 + rank))),
        ("dtype", dict(dtype=(BF16, torch.float16)[rank % 2])),
        ("num_sms", dict(num_sms=None if rank == 0 else 3)),
        ("expand", dict(expand=rank == 0)),
        ("agree_on_inputs", dict(agree_on_inputs=rank == 0)),
        ("ranks_per_node", dict(ranks_per_node=1 + rank)),
        ("ranks_per_node", dict(ranks_per_node=None if rank == 0 else 1)),
    ]
    for name, change in differing:
        kw = {**good, **change}
        _expect_value_error(
            failures,
            f"rank {rank}: {name} differs between ranks",
            lambda kw=kw: Buffer(None, **kw),
            f"{name} differs",
        )
    # Nodes detected from host names: two hosts of one rank each.
    hostname = socket.gethostname
    try:
        socket.gethostname = lambda: f"host{rank}"
        with Buffer(None, **good) as buf:
            if buf.ranks_per_node != 1:
                failures.append(f"rank {rank}: two hosts of one rank: {buf.ranks_per_node}")
    finally:
        socket.gethostname = hostname
    with Buffer(None, **good) as buf:
        failures += _check_round_trip(buf, 10 + rank, 4, 2, "after the refused constructors")
    with Buffer(None, **good, expand=False) as buf:
        x, idx, w = _inputs(20 + rank, 4, 8, 4, 2, BF16)
        _expect_value_error(
            failures,
            f"rank {rank}: an MoE dispatcher on a Buffer without expansion",
            lambda: TokenDispatcher(buf, 2),
            "expand=True",
        )
    return failures


def test_bad_constructor_arguments(launch):
    results = launch(_constructor_body, 2)
    assert_no_failures(results)


# --- routing values, checked on the device ---------------------------------------------------

BAD_RANK, BAD_ROW = 1, 3
RT_H, RT_T, RT_E, RT_K = 6, 6, 6, 2  # W=3: 2 experts per rank


def _bad_routing(kind: str, idx: torch.Tensor) -> torch.Tensor:
    """Copy of ``idx`` with row BAD_ROW (and row 5) made invalid in the way ``kind`` says."""
    idx = idx.clone()
    for row in (BAD_ROW, 5):
        if kind == "too_large":
            idx[row] = torch.tensor([1, RT_E])
        elif kind == "below_minus_one":
            idx[row] = torch.tensor([-2, 0])
        elif kind == "duplicate":
            idx[row] = torch.tensor([4, 4])
        elif kind == "huge_int64":  # wraps to a valid id if narrowed to int32
            idx[row] = torch.tensor([2**32 + 1, -1])
        elif kind == "huge_negative_int64":  # wraps to -1 if narrowed to int32
            idx[row] = torch.tensor([-(2**32) - 1, 2])
    return idx


def _routing_body(rank: int, world_size: int, kinds: list[str]) -> list[str]:
    failures: list[str] = []
    buf = Buffer(
        None,
        hidden_size=RT_H,
        max_tokens_per_rank=RT_T,
        num_experts=RT_E,
        dtype=BF16,
        device=rank_device(),
    )
    num_tokens = (4, RT_T, 5)[rank]
    for i, kind in enumerate(kinds):
        for mode, max_recv in (("exact", None), ("max_recv_tokens", 40)):
            what = f"rank {rank}, {kind} ids on rank {BAD_RANK}, {mode} mode"
            x, idx, w = _inputs(
                1000 * i + 10 * rank + (max_recv is None), num_tokens, RT_H, RT_E, RT_K, BF16
            )
            if rank == BAD_RANK:
                idx = _bad_routing(kind, idx)
            match = f"row {BAD_ROW} " if rank == BAD_RANK else f"rank {BAD_RANK} passed"
            try:
                h = buf.dispatch(x, idx, w, max_recv_tokens=max_recv)[3]
                if max_recv is None or x.device.type == "cpu":
                    failures.append(f"{what}: dispatch did not raise ValueError")
                    continue
                # GPU, max mode: no host sync in dispatch; check() reports it.
                _expect_value_error(failures, f"{what}: check()", lambda h=h: buf.check(h), match)
            except ValueError as e:
                if match not in str(e):
                    failures.append(f"{what}: ValueError {str(e)!r} does not mention {match!r}")
            except Exception as e:
                failures.append(f"{what}: raised {e!r}, expected ValueError")
                return failures  # ranks may be out of step
            # After both modes of a kind (the second bad call is the first's next call).
            if max_recv is not None:
                failures += _check_round_trip(
                    buf,
                    5000 + 1000 * i + rank,
                    num_tokens,
                    RT_K,
                    f"{what}: next call",
                    max_recv_tokens=max_recv,
                )
    buf.destroy()
    return failures


@pytest.mark.slow
def test_invalid_routing_values_raise_on_every_rank(launch):
    # int64 ids past the int32 range must not be narrowed into valid-looking ones.
    kinds = ["too_large", "below_minus_one", "duplicate", "huge_int64", "huge_negative_int64"]
    results = launch(_routing_body, 3, kinds)
    assert_no_failures(results)


# --- a group of one rank ---------------------------------------------------------------------


def _single_rank_body(rank: int, world_size: int) -> list[str]:
    failures: list[str] = []
    with Buffer(
        None, hidden_size=9, max_tokens_per_rank=7, num_experts=3, dtype=torch.float16
    ) as buf:
        failures += _check_round_trip(buf, 1, 7, 2, "W=1 exact")
        failures += _check_round_trip(buf, 2, 5, 3, "W=1 pad 4", pad_multiple=4)
        failures += _check_round_trip(buf, 3, 6, 2, "W=1 truncated", max_recv_tokens=4)
        failures += _check_round_trip(buf, 4, 0, 1, "W=1 no tokens", max_recv_tokens=3)
        # Nobody called check() for the truncated dispatch: the next exact-mode dispatch
        # reports its overflow (once), and the Buffer stays usable.
        x, idx, _ = _inputs(5, 3, buf.hidden_size, buf.num_experts, 1, buf.dtype)
        try:
            buf.dispatch(x, idx)
            failures.append("W=1: exact dispatch after an unchecked overflow did not raise")
        except OverflowError as e:
            if "max_recv_tokens is 4" not in str(e):
                failures.append(f"W=1: OverflowError does not name the limit: {e}")
        failures += _check_round_trip(buf, 6, 7, 2, "W=1 exact after the overflow report")
    return failures


def test_group_of_one_rank(launch):
    (failures,) = launch(_single_rank_body, 1)
    assert not failures, "\n".join(failures)


def test_cpu_ranks_without_the_interpreter_are_told_to_turn_it_on(tmp_path):
    # A fresh process without TRITON_INTERPRET: Triton compiles the kernels for a GPU there is
    # none of, and its own error would come at the first launch.
    script = f"""
import torch.distributed as dist
dist.init_process_group("gloo", init_method="file://{tmp_path}/store", rank=0, world_size=1)
from hybrid_ep_triton import Buffer
try:
    Buffer(None, hidden_size=8, max_tokens_per_rank=4, num_experts=2)
except ValueError as e:
    print(f"ValueError: {{e}}")
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("ValueError: a Buffer on CPU ranks (tokens on the CPU)"), r.stdout
    assert "set TRITON_INTERPRET=1 in the environment before" in r.stdout, r.stdout


@pytest.mark.parametrize(
    "hosts, expected",
    [
        (["a"], 1),
        (["a", "a", "b", "b"], 2),
        (["a", "b", "c"], 1),
        (["a", "b", "a", "b"], None),
        (["a", "a", "b"], None),
        (["a", "a", "b", "b", "b", "b"], None),
    ],
)
def test_nodes_from_host_names(hosts, expected):
    if expected is None:
        with pytest.raises(ValueError, match="consecutive"):
            ranks_per_host(hosts)
    else:
        assert ranks_per_host(hosts) == expected
