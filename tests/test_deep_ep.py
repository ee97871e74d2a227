"""``hybrid_ep_triton.deep_ep`` (DeepEP's Python API) against plain-torch references.

Every rank draws every rank's inputs from shared seeds and computes what DeepEP's calls return
on it from those alone: a normal dispatch's rows (by source rank, then source token index),
its recv_topk_idx (slot k: the local id of the token's expert k, -1 where that expert lives
elsewhere), weights, aligned counts, source indices and the handle's rank_prefix_matrix
column; a combine's per-token sums (and of per-slot weights, plus biases); a low-latency
call's outputs (``hybrid_ep_triton.reference``'s low-latency functions); HybridEP's permuted
rows (grouped by local expert, padded at each expert's end) and its probs' way back. One launch
per group runs a sequence of calls on one object, so calls with another token count (a
growth), another dtype, a cached dispatch and a combine along an older handle follow each
other; every rank returns its failure messages.
"""

from __future__ import annotations

import os
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import torch
from conftest import assert_no_failures, expect_error

BF16 = torch.bfloat16
TOL = 2e-2  # bf16 sums: |got - want| <= TOL * (1 + sum of the summed terms' magnitudes)


# --- inputs and references -----------------------------------------------------------------


def _inputs(
    seed: int,
    rank: int,
    tokens,
    hidden: int,
    experts: int,
    topk: int,
    unused: float = 0.0,
    hot: int | None = None,
):
    """x [T, H] bf16, topk_idx [T, K] int64 (distinct ids, -1 unused) and weights [T, K] float32
    of ``rank``; T = tokens[rank % len(tokens)]; with ``hot`` every token names that expert."""
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    num = tokens[rank % len(tokens)]
    x = torch.randn(num, hidden, generator=gen).to(BF16)
    idx = torch.rand(num, experts, generator=gen).argsort(dim=1)[:, :topk]
    if hot is not None and num:
        idx = torch.where(idx == hot, idx[:, :1], idx)
        idx[:, 0] = hot
    if unused:
        idx[torch.rand(num, topk, generator=gen) < unused] = -1
        if num:
            idx[num // 2] = -1
    weights = torch.rand(num, topk, generator=gen) + 0.1
    return x, idx, weights


def _token_rows(everyone, rank: int, local: int):
    """What DeepEP's dispatch gives ``rank`` from every rank's (x, topk_idx, weights): rows,
    recv_topk_idx, recv_topk_weights, source rank and source token index of each row."""
    rows, ids, weights, src_rank, src_idx = [], [], [], [], []
    first = rank * local
    for source, (x, idx, w) in enumerate(everyone):
        mine = (idx >= first) & (idx < first + local)
        for t in mine.any(dim=1).nonzero().flatten().tolist():
            rows.append(x[t])
            ids.append(torch.where(mine[t], idx[t] - first, -1))
            weights.append(torch.where(mine[t], w[t], 0.0))
            src_rank.append(source)
            src_idx.append(t)
    hidden, topk = everyone[0][0].shape[1], everyone[0][1].shape[1]
    stack = lambda items, shape, dtype: (  # noqa: E731
        torch.stack(items) if items else torch.zeros(shape, dtype=dtype)
    )
    return (
        stack(rows, (0, hidden), BF16),
        stack(ids, (0, topk), torch.int64),
        stack(weights, (0, topk), torch.float32),
        src_rank,
        src_idx,
    )


def _combined(everyone, ys, me: int, local: int, world: int) -> torch.Tensor:
    """float32 [T, ...] of rank ``me``: each token's sum of the rows ``ys[r]`` (rank r's rows,
    in its recv order) that its copies on every rank r became."""
    num = everyone[me][0].shape[0]
    out = torch.zeros(num, *ys[0].shape[1:])
    for r in range(world):
        _, _, _, src_rank, src_idx = _token_rows(everyone, r, local)
        for row, (s, t) in enumerate(zip(src_rank, src_idx, strict=True)):
            if s == me:
                out[t] += ys[r][row].float()
    return out


def _close(got: torch.Tensor, want: torch.Tensor, scale: torch.Tensor, tol: float) -> bool:
    return got.shape == want.shape and bool(
        ((got.float() - want.float()).abs() <= tol * (1 + scale)).all()
    )


# --- the normal mode -----------------------------------------------------------------------


def _normal_mode(rank: int, world: int, hidden: int, experts: int, seed: int) -> list[str]:
    """A sequence of dispatches and combines on one deep_ep.Buffer; failure messages."""
    import torch.distributed as dist

    import hybrid_ep_triton.deep_ep as deep_ep
    from hybrid_ep_triton.tools.launcher import rank_device

    device = rank_device()
    failures: list[str] = []
    fail = failures.append
    local = experts // world
    buffer = deep_ep.Buffer(dist.group.WORLD, int(1e9), 0, explicitly_destroy=True)
    kept = None  # an early handle, combined along after the Buffers grew

    cases = [
        # name, tokens per rank, K, unused, hot, alignment, async, worst, bias
        ("bf16_unused_async_bias", (5, 3), 3, 0.3, None, 1, True, 0, 2),
        ("empty_rank_hot_expert_aligned", (0, 4), 2, 0.0, experts - 1, 4, False, 0, 1),
        ("worst_tokens", (4, 2), 3, 0.2, None, 1, False, 16, 0),
        ("grown_t40", (3, 40), 2, 0.0, None, 1, False, 0, 0),
    ]
    for index, (name, tokens, topk, unused, hot, align, async_finish, worst, biases) in enumerate(
        cases
    ):
        what = f"W{world} {name}"
        everyone = [
            _inputs(seed + index, r, tokens, hidden, experts, topk, unused, hot)
            for r in range(world)
        ]
        x, idx, w = (t.to(device) for t in everyone[rank])
        layout = buffer.get_dispatch_layout(idx, experts)
        want_rows, want_ids, want_w, src_rank, src_idx = _token_rows(everyone, rank, local)
        in_rank = torch.zeros(x.shape[0], world, dtype=torch.bool)
        for r in range(world):
            in_rank[:, r] = ((idx.cpu() >= r * local) & (idx.cpu() < (r + 1) * local)).any(1)
        if not torch.equal(layout[3].cpu(), in_rank):
            fail(f"{what}: is_token_in_rank {layout[3].tolist()}, want {in_rank.tolist()}")
        if layout[0].tolist() != in_rank.sum(0).tolist() or layout[1] is not None:
            fail(f"{what}: num_tokens_per_rank {layout[0].tolist()} / per rdma {layout[1]}")
        per_expert = torch.bincount(idx[idx >= 0].cpu(), minlength=experts)
        if layout[2].tolist() != per_expert.tolist():
            fail(f"{what}: num_tokens_per_expert {layout[2].tolist()}, want {per_expert}")
        previous = deep_ep.Buffer.capture() if async_finish else None
        recv_x, recv_idx, recv_w, counts, handle, event = buffer.dispatch(
            x,
            num_tokens_per_rank=layout[0],
            is_token_in_rank=layout[3],
            num_tokens_per_expert=layout[2],
            topk_idx=idx,
            topk_weights=w,
            expert_alignment=align,
            num_worst_tokens=worst,
            previous_event=previous,
            async_finish=async_finish,
        )
        if async_finish:
            event.current_stream_wait()
        elif event.event is not None:
            fail(f"{what}: a call without async_finish returned an event")
        rows = want_rows.shape[0]
        want_counts = [
            ((want_ids == e).sum().item() + align - 1) // align * align for e in range(local)
        ]
        if worst:
            if recv_x.shape[0] != worst or counts != []:
                fail(f"{what}: {recv_x.shape[0]} rows and counts {counts}, want {worst} and []")
            if (recv_idx[rows:] != -1).any() or (recv_x[rows:] != 0).any():
                fail(f"{what}: rows past the received ones are not -1 ids and zero rows")
        elif counts != want_counts:
            fail(f"{what}: counts {counts}, want {want_counts}")
        got = (recv_x[:rows].cpu(), recv_idx[:rows].cpu(), recv_w[:rows].cpu())
        for part, a, b in zip(
            ("rows", "recv_topk_idx", "recv_topk_weights"),
            got,
            (want_rows, want_ids, want_w),
            strict=True,
        ):
            if not torch.equal(a, b):
                fail(f"{what}: {part} differ from the reference")
        if recv_idx.dtype != torch.int64 or not isinstance(counts, list):
            fail(f"{what}: recv_topk_idx {recv_idx.dtype}, counts {type(counts)}")
        prefix = torch.tensor([sum(1 for s in src_rank if s <= i) for i in range(world)])
        if handle[0][:, rank].tolist() != prefix.tolist() or len(handle) != 6:
            fail(f"{what}: rank_prefix_matrix column {handle[0][:, rank].tolist()}, want {prefix}")
        if handle[3][:rows].tolist() != src_idx:
            fail(f"{what}: recv_src_idx {handle[3].tolist()}, want {src_idx}")

        # Combine: fresh rows and per-slot weights of every rank, in its recv order.
        ys, slot_ws = [], []
        for r in range(world):
            gen = torch.Generator().manual_seed(seed * 7 + index * 31 + r)
            n = _token_rows(everyone, r, local)[0].shape[0]
            n = worst if worst else n
            ys.append(torch.randn(n, hidden, generator=gen).to(BF16))
            slot_ws.append(torch.randn(n, topk, generator=gen))
        gen = torch.Generator().manual_seed(seed + rank)
        bias = [torch.randn(x.shape[0], hidden, generator=gen).to(BF16) for _ in range(biases)]
        given = [b.to(device) for b in bias]
        combined, combined_w, event = buffer.combine(
            ys[rank].to(device),
            handle,
            topk_weights=slot_ws[rank].to(device),
            bias=tuple(given) if biases == 2 else given[0] if given else None,
            async_finish=async_finish,
        )
        if async_finish:
            event.current_stream_wait()
        want = _combined(everyone, ys, rank, local, world) + sum(b.float() for b in bias)
        scale = _combined(everyone, [y.abs() for y in ys], rank, local, world)
        if not _close(combined.cpu(), want, scale + sum(b.float().abs() for b in bias), TOL):
            fail(f"{what}: combined_x differs from the reference")
        want_w = _combined(everyone, slot_ws, rank, local, world)
        if not _close(combined_w.cpu(), want_w, torch.zeros(()), 1e-5):
            fail(f"{what}: combined_topk_weights differ from the reference")

        # A cached dispatch sends new rows along the handle.
        fresh = [(2 * e[0].float() + 1).to(BF16) for e in everyone]
        again = buffer.dispatch(fresh[rank].to(device), handle=handle)
        want_again = _token_rows(
            [(f, *e[1:]) for f, e in zip(fresh, everyone, strict=True)], rank, local
        )[0]
        if again[1:5] != (None, None, None, None):
            fail(f"{what}: a cached dispatch returned {again[1:5]}")
        if not torch.equal(again[0][:rows].cpu(), want_again):
            fail(f"{what}: the cached dispatch's rows differ from the reference")
        if kept is None:
            kept = (handle, everyone, hidden)
    if buffer._normal.capacity < 40 or not buffer._normal.retired:
        fail(f"no growth: capacity {buffer._normal.capacity} after a rank passed 40 tokens")
    # The first case's handle still combines (its Buffers stay after the growth).
    handle, everyone, hidden = kept
    ys = [
        torch.ones(_token_rows(everyone, r, local)[0].shape[0], hidden, dtype=BF16)
        for r in range(world)
    ]
    combined, _, _ = buffer.combine(ys[rank].to(device), handle)
    if not torch.equal(combined.cpu().float(), _combined(everyone, ys, rank, local, world)):
        fail("combine along a handle made before the growth differs from the reference")
    # Weights of another slot count: a ValueError on every rank, and the Buffer goes on.
    wrong = torch.zeros(ys[rank].shape[0], handle.native.topk + 1, device=device)
    try:
        buffer.combine(ys[rank].to(device), handle, topk_weights=wrong)
        fail("a combine with topk_weights of another slot count raised nothing")
    except ValueError as error:
        if "topk_weights" not in str(error):
            fail(f"the slot-count ValueError does not name topk_weights: {error}")
    combined, _, _ = buffer.combine(ys[rank].to(device), handle)
    if not torch.equal(combined.cpu().float(), _combined(everyone, ys, rank, local, world)):
        fail("a combine after a refused one differs from the reference")
    failures += _without_topk(buffer, rank, world, hidden, experts, seed, device)
    failures += _fp8_and_dtype(buffer, rank, world, hidden, experts, seed, device)
    failures += _refusals(buffer)
    buffer.destroy()
    return failures


def _without_topk(buffer, rank, world, hidden, experts, seed, device) -> list[str]:
    """A dispatch routed by is_token_in_rank alone, as DeepEP's test programs make one."""
    failures = []
    local = experts // world
    everyone = [_inputs(seed + 50, r, (4, 6), hidden, experts, 2) for r in range(world)]
    x, idx, _ = (t.to(device) for t in everyone[rank])
    layout = buffer.get_dispatch_layout(idx, experts)
    recv_x, recv_idx, recv_w, counts, handle, _ = buffer.dispatch(
        x,
        num_tokens_per_rank=layout[0],
        is_token_in_rank=layout[3],
        num_tokens_per_expert=layout[2],
    )
    rows, ids, _, _, _ = _token_rows(everyone, rank, local)
    if not torch.equal(recv_x.cpu(), rows) or recv_idx is not None or recv_w is not None:
        failures.append("without topk_idx: rows differ, or recv_topk_idx/weights are not None")
    if counts != [(ids == e).sum().item() for e in range(local)]:
        failures.append(f"without topk_idx: counts {counts}")
    combined, combined_w, _ = buffer.combine(recv_x, handle)
    copies = layout[3].sum(1, keepdim=True).cpu().float()
    if not torch.equal(combined.cpu().float(), x.cpu().float() * copies) or combined_w is not None:
        failures.append("without topk_idx: combine is not each token times its ranks")
    return failures


def _fp8_and_dtype(buffer, rank, world, hidden, experts, seed, device) -> list[str]:
    """FP8 pairs of two scales a row (column-major, as DeepEP's test passes them: the Buffer is
    made again for the new hidden size), then float32 rows."""
    from hybrid_ep_triton import reference

    failures = []
    local, hidden = experts // world, 2 * hidden
    everyone = [_inputs(seed + 60, r, (3, 5), hidden, experts, 2) for r in range(world)]
    x, idx, w = (t.to(device) for t in everyone[rank])
    values, scales = reference.quantize_fp8(x)
    pair = values, scales.T.contiguous().T
    layout = buffer.get_dispatch_layout(idx, experts)
    (recv_values, recv_scales), *_ = buffer.dispatch(
        pair,
        num_tokens_per_rank=layout[0],
        is_token_in_rank=layout[3],
        num_tokens_per_expert=layout[2],
        topk_idx=idx,
        topk_weights=w,
    )
    quantized = [(*reference.quantize_fp8(e[0]), e[1], e[2]) for e in everyone]
    rows_v = _token_rows([(q[0].view(torch.uint8), q[2], q[3]) for q in quantized], rank, local)
    rows_s = _token_rows([(q[1], q[2], q[3]) for q in quantized], rank, local)
    if not torch.equal(recv_values.view(torch.uint8).cpu(), rows_v[0].view(torch.uint8)) or (
        not torch.equal(recv_scales.cpu(), rows_s[0].float())
    ):
        failures.append("fp8 pair: values or scales differ from the reference")
    # float32 rows: the Buffers are made again for the new dtype.
    x32 = x.float()
    recv32, *_, handle, _ = buffer.dispatch(
        x32,
        num_tokens_per_rank=layout[0],
        is_token_in_rank=layout[3],
        num_tokens_per_expert=layout[2],
        topk_idx=idx,
        topk_weights=w,
    )
    rows32 = _token_rows([(e[0].float(), e[1], e[2]) for e in everyone], rank, local)[0]
    combined, _, _ = buffer.combine(recv32, handle)
    if recv32.dtype != torch.float32 or not torch.equal(recv32.cpu(), rows32):
        failures.append("float32 rows differ from the reference")
    copies = layout[3].sum(1, keepdim=True).float()
    if not torch.allclose(combined, x32 * copies):
        failures.append("float32 combine is not each token times its ranks")
    return failures


def _refusals(buffer) -> list[str]:
    """Unsupported arguments are ValueErrors that name them (no call is started)."""
    import torch.distributed as dist

    import hybrid_ep_triton.deep_ep as deep_ep

    failures = []

    expect = partial(expect_error, failures, ValueError)

    x = torch.zeros(1, 128, dtype=BF16)
    idx = torch.zeros(1, 1, dtype=torch.int64)
    expect("mpi4py", lambda: deep_ep.Buffer(None, comm=object()))
    expect("low_latency_mode", lambda: buffer.low_latency_dispatch(x, idx, 1, 2))
    expect("get_comm_stream", buffer.get_comm_stream)
    expect("enable_shrink", lambda: buffer.low_latency_update_mask_buffer(0, True))
    expect("Unsupported number", lambda: deep_ep.Buffer.get_dispatch_config(3))
    expect("even", lambda: deep_ep.Buffer.set_num_sms(3))
    expect("timeout_s", lambda: deep_ep.Buffer(dist.group.WORLD, timeout_s=0))
    expect("explicitly_destroy", deep_ep.Buffer(dist.group.WORLD).destroy)
    return failures


def _bad_input_on_one_rank(rank: int, world: int, hidden: int, experts: int) -> list[str]:
    """Each argument DeepEP asserts on, bad on one rank (the ranks take turns): a ValueError on
    every rank in the same call, the bad rank's own (its words), the others' naming that rank
    (along a handle: at the next dispatch with a new layout, as the native Buffer's); then a
    good call on every rank matches the reference."""
    import torch.distributed as dist

    import hybrid_ep_triton.deep_ep as deep_ep
    from hybrid_ep_triton.tools.launcher import rank_device

    device = rank_device()
    failures: list[str] = []
    fail = failures.append
    local = experts // world
    buffer = deep_ep.Buffer(dist.group.WORLD, explicitly_destroy=True)
    everyone = [_inputs(80, r, (3, 5), hidden, experts, 2) for r in range(world)]
    x, idx, w = (t.to(device) for t in everyone[rank])
    layout = buffer.get_dispatch_layout(idx, experts)
    good = dict(
        num_tokens_per_rank=layout[0],
        is_token_in_rank=layout[3],
        num_tokens_per_expert=layout[2],
        topk_idx=idx,
        topk_weights=w,
    )
    rows, ids, weights, _, _ = _token_rows(everyone, rank, local)
    summed = x.cpu().float() * layout[3].cpu().sum(1, keepdim=True)  # combine of recv_x

    def check_good(what: str, handle=None):
        """A good dispatch (with a handle: none), then a combine, match the reference."""
        if handle is None:
            recv_x, recv_idx, recv_w, counts, handle, _ = buffer.dispatch(x, **good)
            want_counts = [(ids == e).sum().item() for e in range(local)]
            got = recv_x.cpu(), recv_idx.cpu(), recv_w.cpu()
            if not all(map(torch.equal, got, (rows, ids, weights))) or counts != want_counts:
                fail(f"{what}: the next good dispatch differs from the reference")
        combined, _, _ = buffer.combine(rows.to(device), handle)
        if not torch.equal(combined.cpu().float(), summed):
            fail(f"{what}: the next good combine differs from the reference")
        return handle

    def refused(what: str, bad: int, words: str, call, along: bool = False) -> None:
        """``call`` raises on the bad rank (its ``words``) and on the others (its rank); along a
        handle, as the native Buffer's calls there, the others' calls go on and the next
        dispatch with a new layout raises on every rank naming the bad one."""
        try:
            call()
        except ValueError as error:
            want = words if rank == bad else f"rank {bad}"
            if want not in str(error) or (along and rank != bad):
                fail(f"{what}: rank {rank}'s ValueError does not say {want!r}: {error}")
        else:
            if rank == bad or not along:
                fail(f"{what}: rank {rank} raised nothing (bad rank {bad})")
        if along:
            told = f"rank {bad}"
            expect_error(failures, ValueError, told, lambda: buffer.dispatch(x, **good))

    bad_idx = idx.clone()
    bad_idx[0, 0] = experts
    names = "num_tokens_per_rank", "num_tokens_per_rdma_rank", "num_tokens_per_expert"
    bad_layout = dict(zip(names, buffer.get_dispatch_layout(bad_idx, experts), strict=False))
    odd = deep_ep.Config(num_sms=3)
    dispatches = [
        # what, words of the bad rank's error, the bad rank's arguments
        (
            "is_token_in_rank of another shape",
            "is_token_in_rank",
            dict(is_token_in_rank=layout[3][:, :1].contiguous()),
        ),
        ("an expert id >= E", "topk_idx", dict(topk_idx=bad_idx)),
        ("an expert id >= E, with its layout", "topk_idx", dict(bad_layout, topk_idx=bad_idx)),
        (
            "topk_weights [T, 1] beside [T, 2] topk_idx",
            "topk_weights",
            dict(topk_weights=w[:, :1].contiguous()),
        ),
        ("topk_idx without topk_weights", "topk_weights", dict(topk_weights=None)),
        ("num_tokens_per_rank None", "num_tokens_per_rank", dict(num_tokens_per_rank=None)),
        (
            "num_tokens_per_rank int64",
            "num_tokens_per_rank",
            dict(num_tokens_per_rank=layout[0].long()),
        ),
        (
            "num_tokens_per_expert of E + 1",
            "num_tokens_per_expert",
            dict(num_tokens_per_expert=layout[2].new_zeros(experts + 1)),
        ),
        ("x of 3 dimensions", "x", dict(x=x[None])),
        ("x of another dtype", "Buffer", dict(x=x.half())),
        ("expert_alignment 0", "pad_multiple", dict(expert_alignment=0)),
        ("config with an odd num_sms", "num_sms", dict(config=odd)),
        (
            "allocate_on_comm_stream without previous_event",
            "allocate_on_comm_stream",
            dict(allocate_on_comm_stream=True, async_finish=True),
        ),
    ]
    if device.type == "cpu":  # (on GPUs the peers of a call without host sync learn it later)
        dispatches.append(
            (
                "num_worst_tokens without topk_idx",
                "num_worst_tokens",
                dict(topk_idx=None, topk_weights=None),
            )
        )
    # The first call makes the Buffer: its bad argument is refused by the sizing gather.
    for index, (what, words, change) in enumerate(dispatches):
        bad = index % world
        args = {**good, "x": x, **(change if rank == bad else {})}
        if what.startswith("num_worst_tokens"):  # every rank without a host synchronisation
            args["num_worst_tokens"] = 16
        refused(what, bad, words, lambda args=args: buffer.dispatch(**args))
        check_good(what)
    handle = check_good("a good dispatch")
    cached = [
        ("a cached dispatch with topk_idx", "topk_idx", dict(topk_idx=idx)),
        ("a cached dispatch of other tokens", "tokens", dict(x=x[:-1].contiguous())),
        ("a cached dispatch's config with an odd num_sms", "num_sms", dict(config=odd)),
    ]
    for index, (what, words, change) in enumerate(cached):
        bad = index % world
        args = {"x": x, "handle": handle, **(change if rank == bad else {})}
        refused(what, bad, words, lambda args=args: buffer.dispatch(**args), along=True)
        if not torch.equal(buffer.dispatch(x, handle=handle)[0].cpu(), rows):
            fail(f"{what}: the next cached dispatch differs from the reference")
    y = rows.to(device)
    slot_w = torch.ones(y.shape[0], idx.shape[1], device=device)
    combines = [
        (
            "combine's topk_weights of another K",
            "topk_weights",
            dict(topk_weights=slot_w[:, :1].contiguous()),
        ),
        (
            "combine's bias of other rows",
            "bias",
            dict(bias=torch.zeros(x.shape[0] + 1, hidden, dtype=BF16, device=device)),
        ),
        ("combine's bias of three", "bias", dict(bias=(None, None, None))),
        ("combine's x of other rows", "y", dict(x=y[:-1].contiguous())),
        ("combine's config with an odd num_sms", "num_sms", dict(config=odd)),
        (
            "combine's allocate_on_comm_stream",
            "allocate_on_comm_stream",
            dict(allocate_on_comm_stream=True),
        ),
    ]
    for index, (what, words, change) in enumerate(combines):
        bad = index % world
        args = {"x": y, "handle": handle, "topk_weights": slot_w, **(change if rank == bad else {})}
        refused(what, bad, words, lambda args=args: buffer.combine(**args), along=True)
        check_good(what, handle)
    buffer.destroy()
    return failures


def test_bad_input_on_one_rank_is_refused_on_every_rank(launch):
    assert_no_failures(launch(_bad_input_on_one_rank, 2, 128, 8))


@pytest.mark.parametrize(
    "world, hidden, experts, seed",
    [
        pytest.param(2, 128, 8, 1, id="W2"),
        pytest.param(4, 128, 16, 2, id="W4", marks=pytest.mark.slow),
    ],
)
def test_normal_mode_matches_reference(launch, world, hidden, experts, seed):
    failures = [m for r in launch(_normal_mode, world, hidden, experts, seed) for m in r]
    assert not failures, "\n".join(failures)


# --- the low-latency mode ------------------------------------------------------------------


def _low_latency(rank: int, world: int, hidden: int, experts: int) -> list[str]:
    import torch.distributed as dist

    import hybrid_ep_triton.deep_ep as deep_ep
    from hybrid_ep_triton import reference
    from hybrid_ep_triton.tools.launcher import rank_device

    device = rank_device()
    failures: list[str] = []
    fail = failures.append
    budget = deep_ep.Buffer.get_low_latency_rdma_size_hint(6, hidden, world, experts)
    buffer = deep_ep.Buffer(
        dist.group.WORLD,
        0,
        budget,
        low_latency_mode=True,
        num_qps_per_rank=experts // world,
        explicitly_destroy=True,
    )
    buffer.clean_low_latency_buffer(4, hidden, experts)
    for index, (tokens, mp, use_fp8, zero_copy, hook) in enumerate(
        [
            ((4, 2), 4, False, False, False),
            ((3, 0), 4, True, True, True),
            ((9, 5), 9, False, False, False),
        ]
    ):
        what = f"low-latency call {index}"
        everyone = [_inputs(30 + index, r, tokens, hidden, experts, 3, 0.2) for r in range(world)]
        x, idx, w = (t.to(device) for t in everyone[rank])
        stats = torch.zeros(experts // world, dtype=torch.int32, device=device)
        recv_x, count, handle, event, recv_hook = buffer.low_latency_dispatch(
            x,
            idx,
            mp,
            experts,
            stats,
            None,
            use_fp8=use_fp8,
            return_recv_hook=hook,
            async_finish=not hook,
        )
        recv_hook() if hook else event.current_stream_wait()
        src_info, layout_range, got_mp, got_hidden, got_experts = handle  # DeepEP's 5 items
        if (got_mp, got_hidden, got_experts) != (mp, hidden, experts):
            fail(f"{what}: handle holds {(got_mp, got_hidden, got_experts)}")
        want = reference.low_latency_dispatch(
            [e[0] for e in everyone],
            [e[1] for e in everyone],
            experts,
            mp,
            rank,
            use_fp8=use_fp8,
        )
        if not torch.equal(count.cpu(), want.recv_count) or not torch.equal(stats.cpu(), count):
            fail(f"{what}: recv_count {count.tolist()}, want {want.recv_count.tolist()}")
        values = recv_x[0] if use_fp8 else recv_x
        want_values = want.values if use_fp8 else want.recv_x
        for e, n in enumerate(want.recv_count.tolist()):
            a, b = values[e, :n].cpu(), want_values[e, :n]
            if not torch.equal(
                a.view(torch.uint8) if use_fp8 else a, b.view(torch.uint8) if use_fp8 else b
            ):
                fail(f"{what}: expert {e}'s rows differ from the reference")
        ys = []
        for r in range(world):
            gen = torch.Generator().manual_seed(77 + index * 10 + r)
            ys.append(torch.randn(experts // world, world * mp, hidden, generator=gen).to(BF16))
        y = ys[rank].to(device)
        if zero_copy:  # as DeepEP's test: the rows copied into the buffer, x another tensor
            buffer.get_next_low_latency_combine_buffer(handle).copy_(y)
            y = torch.zeros_like(y)
        combined, event, recv_hook = buffer.low_latency_combine(
            y,
            idx,
            w,
            handle,
            use_logfmt=True,
            zero_copy=zero_copy,
            return_recv_hook=hook,
            async_finish=not hook,
        )
        recv_hook() if hook else event.current_stream_wait()
        want_out = reference.low_latency_combine(
            ys, [e[1] for e in everyone], everyone[rank][2], experts, rank
        )
        if not _close(combined.cpu(), want_out, want_out.abs() * 3, TOL):
            fail(f"{what}: combined_x differs from the reference")
    if buffer._low_latency.low_latency_tokens != 9:
        fail(f"low-latency tokens {buffer._low_latency.low_latency_tokens} after M' = 9")

    expect = partial(expect_error, failures, ValueError)

    x, idx, w = (t.to(device) for t in _inputs(3, rank, (2,), hidden, experts, 2))
    expect("use_nvfp4", lambda: buffer.low_latency_dispatch(x, idx, 4, experts, use_nvfp4=True))
    _, _, handle, _, _ = buffer.low_latency_dispatch(x, idx, 4, experts, use_fp8=False)
    rebuilt = tuple(handle)
    expect("token_slots", lambda: buffer.low_latency_combine(x, idx, w, rebuilt))
    combined, _, _ = buffer.low_latency_combine(
        torch.zeros(experts // world, world * 4, hidden, dtype=BF16, device=device),
        idx,
        w,
        handle,
    )
    buffer.destroy()
    return failures


def test_low_latency_mode_matches_reference(launch):
    failures = [m for r in launch(_low_latency, 2, 128, 8) for m in r]
    assert not failures, "\n".join(failures)


def _shrink(rank: int, world: int, hidden: int, experts: int) -> list[str]:
    """enable_shrink as DeepEP's --shrink-test has it: rank 1 fails before its first
    low-latency call (it makes none and destroys its Buffer), rank 0 masks it and goes on
    alone, making the low-latency Buffer in the heap its constructor reserved (no rank waits
    for another there): its outputs are the reference's without rank 1's tokens and experts."""
    import torch.distributed as dist

    import hybrid_ep_triton.deep_ep as deep_ep
    from hybrid_ep_triton import reference
    from hybrid_ep_triton.tools.launcher import rank_device

    device, failures, local = rank_device(), [], experts // world
    rdma_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(4, hidden, world, experts)
    buffer = deep_ep.Buffer(
        dist.group.WORLD,
        0,
        rdma_bytes,
        low_latency_mode=True,
        enable_shrink=True,
        explicitly_destroy=True,
        timeout_s=30,
    )
    if rank == 1:
        buffer.destroy()
        return failures
    buffer.low_latency_update_mask_buffer(1, True)
    for call in range(3):
        everyone = [_inputs(60 + call, r, (4, 3), hidden, experts, 2, 0.2) for r in range(world)]
        everyone[1] = tuple(t[:0] for t in everyone[1])  # no tokens from rank 1
        x, idx, w = (t.to(device) for t in everyone[rank])
        _, count, handle, _, _ = buffer.low_latency_dispatch(x, idx, 4, experts, use_fp8=False)
        want = reference.low_latency_dispatch(
            [e[0] for e in everyone], [e[1] for e in everyone], experts, 4, rank
        )
        if not torch.equal(count.cpu(), want.recv_count):
            failures.append(f"call {call}: recv_count {count.tolist()}, want {want.recv_count}")
        gen = torch.Generator().manual_seed(90 + call)
        ys = [torch.randn(local, world * 4, hidden, generator=gen).to(BF16) for _ in range(world)]
        out, _, _ = buffer.low_latency_combine(ys[rank].to(device), idx, w, handle)
        alive = [torch.where(e[1] // local == 1, -1, e[1]) for e in everyone]
        want_out = reference.low_latency_combine(ys, alive, w.cpu(), experts, rank)
        if not _close(out.cpu(), want_out, want_out.abs() * 3, TOL):
            failures.append(f"call {call}: combined_x differs from the reference")
    mask = torch.full((world,), -1, dtype=torch.int32, device=device)
    buffer.low_latency_query_mask_buffer(mask)
    buffer.low_latency_clean_mask_buffer()
    cleaned = torch.full_like(mask, -1)
    buffer.low_latency_query_mask_buffer(cleaned)
    if mask.tolist() != [0, 1] or cleaned.tolist() != [0, 0]:
        failures.append(f"mask {mask.tolist()}, after cleaning {cleaned.tolist()}")
    if buffer._low_latency.timeout_s != 30:
        failures.append(f"the low-latency Buffer's timeout_s {buffer._low_latency.timeout_s}")
    buffer.destroy()
    return failures


def test_shrink_masks_a_rank_in_the_low_latency_calls(launch):
    failures = [m for r in launch(_shrink, 2, 128, 8) for m in r]
    assert not failures, "\n".join(failures)


def _sized_from_rdma_bytes(rank: int, world: int, hint_tokens: int, hidden: int, experts: int):
    import torch.distributed as dist

    import hybrid_ep_triton.deep_ep as deep_ep
    from hybrid_ep_triton.tools.launcher import rank_device

    budget = deep_ep.Buffer.get_low_latency_rdma_size_hint(hint_tokens, hidden, world, experts)
    buffer = deep_ep.Buffer(
        dist.group.WORLD, 0, budget + 100, low_latency_mode=True, explicitly_destroy=True
    )
    x = torch.zeros(1, hidden, dtype=BF16, device=rank_device())
    idx = torch.zeros(1, 1, dtype=torch.int64, device=x.device)
    buffer.low_latency_dispatch(x, idx, 2, experts, use_fp8=False)
    tokens = buffer._low_latency.low_latency_tokens
    buffer.destroy()
    return tokens


# (70000 tokens' worth of num_rdma_bytes: the low-latency Buffer takes the most it can, 65535)
@pytest.mark.parametrize(
    "hint_tokens, hidden, experts, tokens", [(6, 128, 8, 6), (70000, 16, 2, 65535)]
)
def test_low_latency_buffer_holds_what_num_rdma_bytes_fits(
    launch, hint_tokens, hidden, experts, tokens
):
    assert launch(_sized_from_rdma_bytes, 2, hint_tokens, hidden, experts) == [tokens, tokens]


# --- HybridEPBuffer ------------------------------------------------------------------------


def _permuted(everyone, rank: int, local: int, pad: int):
    """Rows grouped by local expert (by source rank, then token), each expert padded with zero
    rows of prob 0 to a multiple of ``pad``; probs; padded counts; and each row's (source,
    token, expert) (None on padding)."""
    rows, probs, counts, origin = [], [], [], []
    hidden = everyone[0][0].shape[1]
    for e in range(local):
        expert = rank * local + e
        n = 0
        for source, (x, idx, w) in enumerate(everyone):
            for t in (idx == expert).any(1).nonzero().flatten().tolist():
                rows.append(x[t])
                probs.append(w[t][idx[t] == expert][0])
                origin.append((source, t, expert))
                n += 1
        padded = -(-n // pad) * pad
        rows += [torch.zeros(hidden, dtype=BF16)] * (padded - n)
        probs += [torch.tensor(0.0)] * (padded - n)
        origin += [None] * (padded - n)
        counts.append(padded)
    empty = torch.zeros(0, hidden, dtype=BF16)
    rows = torch.stack(rows) if rows else empty
    return rows, torch.stack(probs) if probs else torch.zeros(0), counts, origin


def _hybrid_ep(rank: int, world: int, hidden: int, experts: int) -> list[str]:
    import torch.distributed as dist

    import hybrid_ep_triton.deep_ep as deep_ep
    from hybrid_ep_triton.deep_ep.hybrid_ep_buffer import indices_to_map
    from hybrid_ep_triton.tools.launcher import rank_device

    device = rank_device()
    failures: list[str] = []
    fail = failures.append
    local = experts // world
    buffer = deep_ep.HybridEPBuffer(dist.group.WORLD, hidden, 4, local, num_sms_dispatch_api=8)
    for index, (tokens, pad, mode) in enumerate(
        [((4, 3), 4, "map"), ((0, 5), 1, "topk"), ((6, 20), 2, "map")]
    ):
        what = f"dispatch_with_permute {index} ({mode}, pad {pad})"
        everyone = [_inputs(40 + index, r, tokens, hidden, experts, 2, 0.2) for r in range(world)]
        x, idx, w = (t.to(device) for t in everyone[rank])
        routing_map, probs = indices_to_map(idx, w, x.shape[0], experts)
        routing = (
            dict(routing_map=routing_map, probs=probs)
            if mode == "map"
            else dict(topk_idx=idx, topk_weights=w, num_of_experts=experts)
        )
        rows, got_probs, scales, tokens_per_expert, handle = buffer.dispatch_with_permute(
            hidden=x, num_of_experts_per_rank=local, pad_multiple=pad, **routing
        )
        want_rows, want_probs, want_counts, origin = _permuted(everyone, rank, local, pad)
        if not torch.equal(rows.cpu(), want_rows) or not torch.equal(got_probs.cpu(), want_probs):
            fail(f"{what}: rows or probs differ from the reference")
        if tokens_per_expert.tolist() != want_counts or tokens_per_expert.device.type != "cpu":
            fail(f"{what}: tokens_per_expert {tokens_per_expert}, want {want_counts} on the CPU")
        if scales is not None or handle[-1].tolist() != [0] or handle[8] != x.shape[0]:
            fail(f"{what}: scales {scales}, overflow {handle[-1]}, tokens {handle[8]}")
        # Back: the rows' sum per token, and each row's prob at its (token, expert).
        gen = torch.Generator().manual_seed(90 + index)
        ys = [
            torch.randn(len(_permuted(everyone, r, local, pad)[3]), hidden, generator=gen)
            for r in range(world)
        ]
        grads = [
            torch.randn(len(_permuted(everyone, r, local, pad)[3]), generator=gen)
            for r in range(world)
        ]
        combined, combined_probs = buffer.combine_with_unpermute(
            hidden=ys[rank].to(BF16).to(device),
            probs=grads[rank].to(device),
            handle=handle,
            pad_multiple=pad,
        )
        want = torch.zeros(x.shape[0], hidden)
        want_grad = torch.zeros(x.shape[0], experts)
        scale = torch.zeros(x.shape[0], hidden)
        for r in range(world):
            for row, where in enumerate(_permuted(everyone, r, local, pad)[3]):
                if where is not None and where[0] == rank:
                    want[where[1]] += ys[r][row].to(BF16).float()
                    scale[where[1]] += ys[r][row].abs()
                    want_grad[where[1], where[2]] = grads[r][row]
        if not _close(combined.cpu(), want, scale, TOL):
            fail(f"{what}: combined rows differ from the reference")
        if not torch.equal(combined_probs.cpu(), want_grad):
            fail(f"{what}: combined_probs differ from the reference")
        # Along the handle: new rows, the same places.
        again, *_ = buffer.dispatch_with_permute(hidden=(x * 2).contiguous(), handle=handle)
        if not torch.equal(again.cpu(), (want_rows.float() * 2).to(BF16)):
            fail(f"{what}: a dispatch along the handle differs from the reference")

    # Non-blocking: a fixed row count; overflow flagged where the rows needed more.
    everyone = [_inputs(60, r, (5, 5), hidden, experts, 2) for r in range(world)]
    x, idx, w = (t.to(device) for t in everyone[rank])
    routing_map, probs = indices_to_map(idx, w, x.shape[0], experts)
    rows, _, _, tokens_per_expert, handle = buffer.dispatch_with_permute(
        hidden=x, routing_map=routing_map, probs=probs, num_permuted_tokens=4, non_blocking=True
    )
    needed = sum(_permuted(everyone, rank, local, 1)[2])
    if rows.shape[0] != 4 or handle[-1].tolist() != [int(needed > 4)]:
        fail(f"non-blocking: {rows.shape[0]} rows, overflow {handle[-1]} ({needed} needed)")
    if tokens_per_expert.device != x.device:
        fail("non-blocking: tokens_per_expert is not on the rows' device")

    # Without the permute: one row per (token, rank), the local experts' map and probs.
    x, idx, w = (t.to(device) for t in _inputs(70, rank, (3, 4), hidden, experts, 2))
    everyone = [_inputs(70, r, (3, 4), hidden, experts, 2) for r in range(world)]
    token_rows, dispatched_probs, _, handle = buffer.dispatch(
        x, topk_idx=idx, topk_weights=w, num_of_experts=experts
    )
    want_rows, want_ids, want_w, _, _ = _token_rows(everyone, rank, local)
    local_map = torch.zeros(want_ids.shape[0], local, dtype=torch.bool)
    want_probs = torch.zeros(want_ids.shape[0], world * local)
    for row in range(want_ids.shape[0]):
        for k in range(want_ids.shape[1]):
            if want_ids[row, k] >= 0:
                local_map[row, want_ids[row, k]] = True
                want_probs[row, rank * local + want_ids[row, k]] = want_w[row, k]
    if not torch.equal(token_rows.cpu(), want_rows) or not torch.equal(handle[4].cpu(), local_map):
        fail("dispatch without permute: rows or local_expert_routing_map differ")
    if not torch.equal(dispatched_probs.cpu(), want_probs):
        fail("dispatch without permute: dispatched_probs differ from the reference")
    combined, _ = buffer.combine(token_rows, handle=handle)
    copies = _token_ranks_of(idx.cpu(), local, world).sum(1, keepdim=True).float()
    if not torch.equal(combined.cpu().float(), x.cpu().float() * copies):
        fail("combine without permute is not each token times its ranks")
    buffer.destroy()
    return failures


def _token_ranks_of(idx, local, world):
    return torch.stack(
        [((idx >= r * local) & (idx < (r + 1) * local)).any(1) for r in range(world)], dim=1
    )


def test_hybrid_ep_buffer_matches_reference(launch):
    failures = [m for r in launch(_hybrid_ep, 2, 64, 8) for m in r]
    assert not failures, "\n".join(failures)


# --- in this process -----------------------------------------------------------------------


def test_register_makes_deep_ep_this_package():
    import hybrid_ep_triton.deep_ep as ours

    saved = {name: m for name, m in sys.modules.items() if name.split(".")[0] == "deep_ep"}
    try:
        for name in saved:
            del sys.modules[name]
        sys.modules["deep_ep"] = type(sys)("deep_ep")  # another deep_ep, imported first
        with pytest.raises(RuntimeError, match="another deep_ep"):
            ours.register()
        del sys.modules["deep_ep"]
        ours.register()
        ours.register()  # idempotent
        import deep_ep
        import deep_ep.buffers.legacy
        import deep_ep.utils.event
        from deep_ep import Buffer, Config, HybridEPBuffer, topk_idx_t
        from deep_ep.hybrid_ep_buffer import indices_to_map
        from deep_ep.utils import EventHandle, EventOverlap

        assert deep_ep is ours and deep_ep.buffers.legacy.Buffer is Buffer is ours.Buffer
        assert (Config, HybridEPBuffer, topk_idx_t) == (
            ours.Config,
            ours.HybridEPBuffer,
            torch.int64,
        )
        assert deep_ep.utils.event.EventOverlap is EventOverlap
        assert callable(indices_to_map)
        EventOverlap(EventHandle()).current_stream_wait()  # no CUDA here: nothing to wait for
    finally:
        for name in [n for n in sys.modules if n.split(".")[0] == "deep_ep"]:
            del sys.modules[name]
        sys.modules.update(saved)


def test_size_hints_are_deepeps():
    import hybrid_ep_triton.deep_ep as deep_ep
    from hybrid_ep_triton.runtime.planner import deepep_low_latency_bytes

    for tokens, hidden, world, experts in [(128, 7168, 8, 256), (1, 128, 2, 4), (37, 2048, 16, 64)]:
        assert deep_ep.Buffer.get_low_latency_rdma_size_hint(
            tokens, hidden, world, experts
        ) == deepep_low_latency_bytes(tokens, hidden, world, experts)
    # DeepEP's NVLink hint, term by term, for 24 SMs (12 channels) on 8 ranks, 14336-byte rows.
    config = deep_ep.Config(24, 8, 256)
    channels, ranks, tokens = 12, 8, 256
    per_token = 14336 + 8 + 128 * 8 + 128 * 4 + 128 * 4
    want = channels * ranks * 5 * 4 + channels * ranks * tokens * per_token
    assert config.get_nvl_buffer_size_hint(14336, 8) == -(-want // 128) * 128
    assert config.get_rdma_buffer_size_hint(14336, 8) == 0
    assert deep_ep.Config(20, 6, 256, 6, 128).num_max_rdma_chunked_recv_tokens == 132
    assert deep_ep.Buffer.get_dispatch_config(8).num_max_nvl_chunked_send_tokens == 6


@pytest.mark.gpu
@pytest.mark.parametrize("program", ["intranode", "low_latency"])
def test_deepeps_own_test_programs(program):
    """DeepEP's tests/legacy programs on 2 ranks sharing the GPU (tests/deep_ep_programs.py);
    HEP_DEEPEP_DIR names the copy of DeepEP's files that runner reads."""
    deepep_dir = os.environ.get("HEP_DEEPEP_DIR")
    if not deepep_dir:
        pytest.skip("set HEP_DEEPEP_DIR to a copy of DeepEP's files (tests/deep_ep_programs.py)")
    runner = Path(__file__).with_name("deep_ep_programs.py")
    sizes = ["--num-tokens", "64", "--hidden", "2048", "--num-topk", "4", "--num-experts", "16"]
    result = subprocess.run(
        [sys.executable, str(runner), deepep_dir, "--program", program, "--ranks", "2", *sizes],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert result.returncode == 0, result.stdout[-20000:] + result.stderr[-20000:]
