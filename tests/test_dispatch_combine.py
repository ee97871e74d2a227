"""``Buffer.dispatch`` / ``Buffer.combine`` against the plain-torch ``hybrid_ep_triton.reference``.

Dispatch must match the reference bit for bit (recv_x, recv_weights, tokens_per_expert; with
expand=False recv_x, recv_topk_idx, recv_topk_weights, tokens_per_expert), also for a cached
dispatch along an earlier handle. Combine sends partial sums per (token, rank) in
the Buffer's dtype, so it is compared with a tolerance of about two ulps of the dtype, scaled
by the magnitude of the summed terms (sum over a token's slots of |weight * y|, which bounds the
partial sums that get rounded).

Groups with ``ranks_per_node`` simulate nodes: ranks of another node are reached only through
the network puts of the kernels' primitives (on CPU ranks a copy into the peer's shared memory
that must come from the sender's own heap), and every dispatch must put exactly one row per
distinct (token, other node) pair over the network, counted by the kernels themselves.

Spawning a process group costs seconds and the Triton interpreter is slow, so every test spawns
its ranks once, builds ONE Buffer (hidden size, dtype and expert count are fixed per Buffer) and
runs a list of cases on it in sequence. That sequence is itself the repeated-call test: T,
routing, pad_multiple and the exact / max_recv_tokens mode change from call to call, with cached
dispatches and double combines in between. Every rank returns a list of failure messages, and
the test asserts that all lists are empty. Inputs are drawn from a seed of (group, case, rank):
deterministic, and different for every case.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from conftest import assert_no_failures, raised

from hybrid_ep_triton import Buffer, reference
from hybrid_ep_triton.tools.launcher import rank_device

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
I32, I64 = torch.int32, torch.int64
MAX_TOKENS = 12  # max_tokens_per_rank of every Buffer here: cases use 0..12 tokens per rank
# Combine tolerance per dtype: |out - ref| <= TOL * (1 + sum over slots of |weight * y|).
TOL = {BF16: 2e-2, FP16: 2e-3, FP32: 1e-5}


@dataclass(frozen=True)
class Case:
    """One dispatch (+ combines) on the group's Buffer.

    tokens: T of rank r is tokens[r % len(tokens)].
    hot_expert: every token picks this global expert, and fills its other slots with other
        experts of the same rank (then -1), so one rank receives every row.
    unused_prob: chance that a slot is -1; with it, one token per rank has only -1 slots.
    recv: "exact" (max_recv_tokens=None), or max_recv_tokens M relative to the rows needed:
        "fit" (M = needed), "more" (needed + 5: zero tail), "less" (needed // 2: truncation),
        "zero" (M = 0).
    combine: weight modes of the combines run on the handle, in order: "recv" passes
        recv_weights, "none" passes None.
    cached: then dispatch new rows (and new weights) along the handle, and combine them.
    strided: x and y are column slices of wider tensors (row stride > H, storage offset > 0).
    """

    name: str
    tokens: tuple[int, ...] = (5, 9, 3, 12)
    topk: int = 2
    idx_dtype: torch.dtype = I64
    unused_prob: float = 0.0
    hot_expert: int | None = None
    with_weights: bool = True
    pad_multiple: int = 1
    recv: str = "exact"
    combine: tuple[str, ...] = ("recv",)
    cached: bool = False
    strided: bool = False


@dataclass(frozen=True)
class Group:
    """The cases run in order on one Buffer of one spawn of world_size ranks."""

    world_size: int
    hidden: int
    dtype: torch.dtype
    num_experts: int
    seed: int
    cases: tuple[Case, ...]
    expand: bool = True  # the Buffer's: expert-major rows, or one row per token
    ranks_per_node: int | None = None  # the Buffer's: simulated nodes of that many ranks

    @property
    def id(self) -> str:
        rows = "" if self.expand else "-token_rows"
        nodes = ""
        if self.ranks_per_node is not None:
            nodes = f"-{self.world_size // self.ranks_per_node}x{self.ranks_per_node}"
        dtype = str(self.dtype).removeprefix("torch.")
        return f"W{self.world_size}{nodes}-H{self.hidden}-{dtype}{rows}"


GROUPS = [
    # W=2, E=8: 4 experts per rank. Modes alternate exact / max_recv_tokens.
    Group(
        2,
        7,
        BF16,
        8,
        seed=1,
        cases=(
            Case("basic", tokens=(5, 9)),
            Case(
                "int32_unused_pad3_zero_tail_cached",
                tokens=(7, 4),
                topk=3,
                idx_dtype=I32,
                unused_prob=0.3,
                pad_multiple=3,
                recv="more",
                combine=("none",),
                cached=True,
            ),
            Case(
                "k1_pad8_no_weights",
                tokens=(6, 10),
                topk=1,
                with_weights=False,
                pad_multiple=8,
                combine=("none",),
            ),
            Case("hot_expert_k1_fit", tokens=(12, 12), topk=1, hot_expert=5, recv="fit"),
            Case("all_ranks_empty", tokens=(0,), combine=("none",)),
            Case("empty_rank_truncated", tokens=(0, 11), recv="less", combine=("none", "recv")),
            Case(
                "strided_int32_pad8",
                tokens=(9, 3),
                topk=4,
                idx_dtype=I32,
                pad_multiple=8,
                strided=True,
            ),
            Case(
                "k8_all_experts_pad3_truncated_cached",
                tokens=(4, 6),
                topk=8,
                unused_prob=0.25,
                pad_multiple=3,
                recv="less",
                cached=True,
            ),
            Case(
                "all_slots_maybe_unused",
                tokens=(8, 2),
                topk=2,
                unused_prob=0.6,
                combine=("recv", "none"),
            ),
            Case("all_ranks_empty_zero_tail", tokens=(0,), pad_multiple=8, recv="more"),
            Case("hot_expert_k3_cached", tokens=(10, 8), topk=3, hot_expert=2, cached=True),
            Case("dispatch_only_fit", tokens=(7, 7), unused_prob=0.2, recv="fit", combine=()),
            Case("max_recv_zero", tokens=(3, 5), recv="zero"),
            Case("after_zero", tokens=(12, 1), topk=3, idx_dtype=I32, pad_multiple=3),
        ),
    ),
    Group(
        2,
        33,
        FP16,
        8,
        seed=2,
        cases=(
            Case("int32_unused_fit", tokens=(6, 11), idx_dtype=I32, unused_prob=0.2, recv="fit"),
            Case(
                "k3_pad3_both_combines",
                tokens=(9, 5),
                topk=3,
                pad_multiple=3,
                combine=("recv", "none"),
            ),
            Case("hot_expert_rank0_truncated", tokens=(7, 12), hot_expert=0, recv="less"),
            Case(
                "no_weights_strided",
                tokens=(4, 10),
                topk=1,
                with_weights=False,
                strided=True,
                combine=("none",),
            ),
            Case(
                "zero_tail_cached",
                tokens=(12, 3),
                topk=4,
                unused_prob=0.3,
                pad_multiple=8,
                recv="more",
                cached=True,
            ),
        ),
    ),
    # H=100 > the interpreter's 64-wide tiles: two tiles per row, the second partial.
    Group(
        2,
        100,
        FP32,
        8,
        seed=3,
        cases=(
            Case("basic", tokens=(5, 8)),
            Case(
                "int32_pad8_truncated",
                tokens=(10, 7),
                topk=3,
                idx_dtype=I32,
                pad_multiple=8,
                recv="less",
            ),
            Case("hot_expert_k1", tokens=(6, 9), topk=1, hot_expert=7, combine=("none", "recv")),
            Case(
                "empty_rank_zero_tail_cached",
                tokens=(8, 0),
                unused_prob=0.3,
                recv="more",
                cached=True,
                combine=("none",),
            ),
        ),
    ),
    # W=4, E=8: 2 experts per rank, so K=3 and K=4 exceed the experts of one rank.
    Group(
        4,
        13,
        BF16,
        8,
        seed=4,
        cases=(
            Case("basic", tokens=(5, 12, 3, 9)),
            Case(
                "k3_int32_pad3_zero_tail_cached",
                tokens=(6, 2, 11, 4),
                topk=3,
                idx_dtype=I32,
                unused_prob=0.2,
                pad_multiple=3,
                recv="more",
                cached=True,
            ),
            Case("hot_expert_on_empty_rank", tokens=(7, 12, 0, 5), topk=1, hot_expert=4),
            Case(
                "k3_pad8_truncated",
                tokens=(8, 3, 10, 6),
                topk=3,
                pad_multiple=8,
                recv="less",
                combine=("none", "recv"),
            ),
            Case("all_ranks_empty", tokens=(0,)),
            Case("dispatch_only_truncated", tokens=(4, 9, 6, 2), recv="less", combine=()),
            Case(
                "int32_no_weights_fit",
                tokens=(12, 1, 0, 6),
                idx_dtype=I32,
                with_weights=False,
                recv="fit",
                combine=("none",),
            ),
            Case(
                "k1_pad3_unused_strided",
                tokens=(9, 4, 7, 11),
                topk=1,
                unused_prob=0.3,
                pad_multiple=3,
                strided=True,
                combine=("recv", "none"),
            ),
            Case(
                "k4_zero_tail_cached",
                tokens=(3, 9, 5, 0),
                topk=4,
                unused_prob=0.2,
                recv="more",
                cached=True,
            ),
        ),
    ),
    Group(
        4,
        33,
        FP32,
        8,
        seed=5,
        cases=(
            Case("unused_pad3", tokens=(4, 7, 10, 2), topk=3, unused_prob=0.2, pad_multiple=3),
            Case("int32_truncated", tokens=(9, 5, 3, 12), idx_dtype=I32, recv="less"),
            Case(
                "hot_rank0_fit_cached",
                tokens=(6, 0, 8, 3),
                hot_expert=1,
                recv="fit",
                cached=True,
                combine=("none",),
            ),
        ),
    ),
    # One row per token (expand=False): no padding; K=8 at W=2 exceeds the experts of a rank.
    Group(
        2,
        7,
        BF16,
        8,
        seed=9,
        expand=False,
        cases=(
            Case("basic", tokens=(5, 9), combine=("recv", "none")),
            Case(
                "int32_unused_zero_tail_cached",
                tokens=(7, 4),
                topk=3,
                idx_dtype=I32,
                unused_prob=0.3,
                recv="more",
                cached=True,
            ),
            Case(
                "hot_expert_truncated_cached",
                tokens=(12, 10),
                topk=3,
                hot_expert=5,
                recv="less",
                cached=True,
            ),
            Case("k8_unused_strided", tokens=(6, 8), topk=8, unused_prob=0.25, strided=True),
            Case("empty_rank_no_weights", tokens=(0, 11), with_weights=False, combine=("none",)),
            Case("max_recv_zero", tokens=(3, 5), recv="zero"),
            Case("k3_aligned_counts", tokens=(10, 6), topk=3, pad_multiple=4),
        ),
    ),
    Group(
        4,
        13,
        FP32,
        8,
        seed=10,
        expand=False,
        cases=(
            Case("k3_unused_fit", tokens=(5, 12, 0, 9), topk=3, unused_prob=0.2, recv="fit"),
            Case(
                "int32_truncated_cached",
                tokens=(8, 3, 10, 6),
                idx_dtype=I32,
                recv="less",
                cached=True,
                combine=("none", "recv"),
            ),
        ),
    ),
    # W=8, E=16: slow on two cores, so only two cases.
    Group(
        8,
        13,
        BF16,
        16,
        seed=6,
        cases=(
            Case(
                "k3_unused_pad3_empty_ranks",
                tokens=(3, 0, 5, 2, 6, 0, 4, 1),
                topk=3,
                unused_prob=0.2,
                pad_multiple=3,
            ),
            Case(
                "int32_truncated_cached",
                tokens=(4, 2, 0, 5, 3, 6, 1, 2),
                idx_dtype=I32,
                recv="less",
                cached=True,
                combine=("none",),
            ),
        ),
    ),
]
# Across nodes (simulated: ranks of other nodes are reached only by network puts).
# Every case also counts the rows that crossed the network (see _run_case).
NODE_GROUPS = [
    Group(
        2,
        7,
        BF16,
        8,
        seed=11,
        ranks_per_node=1,
        cases=(
            Case(
                "strided_cached", tokens=(5, 9), strided=True, cached=True, combine=("recv", "none")
            ),
            Case(
                "empty_rank_pad3_truncated",
                tokens=(0, 11),
                unused_prob=0.3,
                pad_multiple=3,
                recv="less",
            ),
            Case("node_receives_nothing_fit", tokens=(12, 7), topk=3, hot_expert=1, recv="fit"),
        ),
    ),
    Group(
        4,
        13,
        FP16,
        16,
        seed=12,
        ranks_per_node=2,
        cases=(
            Case(
                "int32_uneven_unused_pad3_cached",
                tokens=(6, 0, 11, 3),
                topk=4,
                idx_dtype=I32,
                unused_prob=0.3,
                pad_multiple=3,
                cached=True,
            ),
            Case(
                "hot_expert_zero_tail",
                tokens=(9, 4, 0, 12),
                topk=3,
                hot_expert=13,
                recv="more",
                combine=("none", "recv"),
            ),
        ),
    ),
    Group(
        4,
        13,
        BF16,
        16,
        seed=13,
        ranks_per_node=2,
        expand=False,
        cases=(
            Case(
                "unused_truncated_cached",
                tokens=(5, 12, 7, 0),
                topk=4,
                unused_prob=0.2,
                recv="less",
                cached=True,
            ),
        ),
    ),
    Group(
        8,
        9,
        BF16,
        16,
        seed=14,
        ranks_per_node=4,
        cases=(
            Case(
                "k3_unused_empty_ranks_cached",
                tokens=(3, 0, 5, 2, 6, 1, 4, 2),
                topk=3,
                unused_prob=0.2,
                cached=True,
            ),
        ),
    ),
    Group(
        8,
        9,
        FP32,
        16,
        seed=15,
        ranks_per_node=2,
        cases=(
            Case(
                "k4_pad3_truncated",
                tokens=(4, 2, 0, 5, 3, 6, 1, 2),
                topk=4,
                pad_multiple=3,
                recv="less",
            ),
        ),
    ),
]
# One rank, on GPUs only (on CPU ranks the groups above cover the same code): every row stays
# on its rank; the wide row uses the GPU configuration's full tiles and column slices. (Only a
# peer can truncate what an empty rank receives.)
ONE_RANK_GROUPS = [
    Group(
        1,
        7,
        BF16,
        8,
        seed=7,
        cases=tuple(case for case in GROUPS[0].cases if case.name != "empty_rank_truncated"),
    ),
    Group(1, 7168, BF16, 16, seed=8, cases=GROUPS[3].cases),
]


# --- inputs --------------------------------------------------------------------------------


def _rows(num: int, hidden: int, dtype: torch.dtype, gen, strided: bool) -> torch.Tensor:
    """Random [num, hidden] rows; a column slice of a wider tensor when ``strided``."""
    if not strided:
        return torch.randn(num, hidden, generator=gen).to(dtype)
    wide = torch.randn(num, hidden + 5, generator=gen).to(dtype)
    return wide[:, 2 : 2 + hidden]


def _routing(case: Case, num_tokens: int, num_experts: int, local: int, gen) -> torch.Tensor:
    """[T, K] distinct expert ids per row, with -1 slots (see ``Case``)."""
    k = case.topk
    if case.hot_expert is None:
        idx = torch.rand(num_tokens, num_experts, generator=gen).topk(k, dim=1).indices
        idx[torch.rand(num_tokens, k, generator=gen) < case.unused_prob] = -1
        if case.unused_prob and num_tokens:
            idx[num_tokens // 2] = -1  # one token with no valid slot at all
    else:
        hot = case.hot_expert
        first = hot // local * local
        others = torch.tensor([e for e in range(first, first + local) if e != hot])
        idx = torch.full((num_tokens, k), -1, dtype=torch.int64)
        idx[:, 0] = hot
        n = min(k - 1, others.numel())
        if n:
            pick = torch.rand(num_tokens, others.numel(), generator=gen).argsort(dim=1)
            idx[:, 1 : 1 + n] = others[pick[:, :n]]
        # Shuffle the slots of every row so the hot expert is not always in slot 0.
        idx = idx.gather(1, torch.rand(num_tokens, k, generator=gen).argsort(dim=1))
    return idx.to(case.idx_dtype)


# --- checks --------------------------------------------------------------------------------


def _diff(got: torch.Tensor, want: torch.Tensor) -> str:
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"got {tuple(got.shape)} {got.dtype}, reference {tuple(want.shape)} {want.dtype}"
    bad = got != want
    if bad.dim() > 1:
        bad = bad.any(dim=1)
    rows = bad.nonzero().flatten()
    return f"{rows.numel()} rows differ, first {rows[:8].tolist()}"


def _outputs(got: tuple, expand: bool) -> dict:
    """dispatch's tensors by name (Buffer's and the reference's have the same order)."""
    names = ["recv_x", "recv_weights", "tokens_per_expert"]
    if not expand:
        names = ["recv_x", "recv_topk_idx", "recv_weights", "tokens_per_expert"]
    return dict(zip(names, got, strict=False))


def _check_dispatch(fail, what: str, got: dict, want: dict, num_valid: int) -> None:
    """Bit-exact comparison with the reference; rows past ``num_valid`` must be zero."""
    rx, ex = got["recv_x"], want["recv_x"]
    if rx.dtype != ex.dtype or not torch.equal(rx, ex):
        fail(f"{what}: recv_x differs from the reference: {_diff(rx, ex)}")
    rw, ew = got["recv_weights"], want["recv_weights"]
    if (rw is None) != (ew is None):
        fail(f"{what}: recv_weights is {type(rw).__name__}, reference {type(ew).__name__}")
    elif rw is not None and (rw.dtype != torch.float32 or not torch.equal(rw, ew)):
        fail(f"{what}: recv_weights differs from the reference: {_diff(rw, ew)}")
    if "recv_topk_idx" in want:
        ri, ei = got["recv_topk_idx"], want["recv_topk_idx"]
        if ri.dtype != ei.dtype or not torch.equal(ri, ei):
            fail(f"{what}: recv_topk_idx differs from the reference: {_diff(ri, ei)}")
    tpe, etpe = got["tokens_per_expert"], want["tokens_per_expert"]
    if tpe.dtype != torch.int64 or not torch.equal(tpe, etpe):
        fail(f"{what}: tokens_per_expert {tpe.tolist()} ({tpe.dtype}), reference {etpe.tolist()}")
    tail = (rx[num_valid:] != 0).any(dim=1).nonzero().flatten() + num_valid
    if tail.numel():
        fail(f"{what}: rows past the valid count {num_valid} are not zero: {tail[:8].tolist()}")
    if rw is not None and (rw[num_valid:] != 0).any():
        fail(f"{what}: recv_weights past the valid count {num_valid} are not zero")


def _check_combine(fail, what: str, out, want, magnitude, topk_idx, dtype) -> None:
    if out.dtype != dtype or out.shape != want.shape:
        fail(f"{what}: out is {tuple(out.shape)} {out.dtype}, reference {tuple(want.shape)}")
        return
    err = (out.float() - want.float()).abs()
    allowed = TOL[dtype] * (1 + magnitude)
    bad = (err > allowed).any(dim=1).nonzero().flatten()
    if bad.numel():
        worst = (err / allowed).flatten().argmax()
        fail(
            f"{what}: {bad.numel()} tokens off the reference, first {bad[:8].tolist()}; worst "
            f"error {err.flatten()[worst]:.3g} > allowed {allowed.flatten()[worst]:.3g}"
        )
    no_slot = (topk_idx < 0).all(dim=1)
    if (out[no_slot] != 0).any():
        fail(f"{what}: tokens without a valid slot are not zero: {no_slot.nonzero().tolist()}")


# --- rank body -----------------------------------------------------------------------------


def _to(t: torch.Tensor | None, device) -> torch.Tensor | None:
    return None if t is None else t.to(device)


def _run_case(buf: Buffer, rank: int, world: int, grp: Group, index: int, case: Case, fail):
    """Dispatch (+ check, combines, cached dispatch) on ``buf`` and on the reference.

    Inputs are drawn on the CPU, both implementations run on the test device, and the results
    are compared on the CPU.
    """
    group, dev = dist.group.WORLD, rank_device()
    hidden, dtype, num_experts = grp.hidden, grp.dtype, grp.num_experts
    gen = torch.Generator().manual_seed(grp.seed * 100_000 + index * 100 + rank)
    num_tokens = case.tokens[rank % len(case.tokens)]
    x = _rows(num_tokens, hidden, dtype, gen, case.strided)
    idx = _routing(case, num_tokens, num_experts, num_experts // world, gen)
    w = torch.rand(num_tokens, case.topk, generator=gen) if case.with_weights else None
    kw = dict(num_experts=num_experts, pad_multiple=case.pad_multiple, expand=grp.expand)

    def ref_dispatch(x_, w_, max_recv):
        got = reference.dispatch(
            group, _to(x_, dev), _to(idx, dev), _to(w_, dev), max_recv_tokens=max_recv, **kw
        )
        return _outputs([_to(t, "cpu") for t in got[:-1]], grp.expand), got[-1]

    def buf_dispatch(x_, w_, **more):
        got = buf.dispatch(_to(x_, dev), topk_weights=_to(w_, dev), **more)
        return _outputs([_to(t, "cpu") for t in got[:-1]], grp.expand), got[-1]

    max_recv = None
    if case.recv != "exact":
        needed = ref_dispatch(x, w, None)[1].num_recv_rows
        max_recv = {"fit": needed, "more": needed + 5, "less": needed // 2, "zero": 0}[case.recv]
        if case.recv == "less":  # some rank must actually drop rows, or the case is vacuous
            dropping = torch.tensor([int(needed > max_recv)], device=dev)
            dist.all_reduce(dropping, op=dist.ReduceOp.MAX)
            if not dropping.item() and rank == 0:
                fail("no rank drops rows in this truncation case: change its inputs")
    want, eh = ref_dispatch(x, w, max_recv)
    needed = eh.num_recv_rows  # rows of the exact layout, also when truncated
    num_rows = want["recv_x"].shape[0]
    num_valid = min(needed, num_rows)

    sent_before = buf.network_rows
    local = num_experts // world
    stats = torch.full((local,), index, dtype=torch.int64, device=dev)  # dispatch adds into it
    got, handle = buf_dispatch(
        x,
        w,
        topk_idx=_to(idx, dev),
        pad_multiple=case.pad_multiple,
        max_recv_tokens=max_recv,
        expert_recv_stats=stats,
    )
    _check_dispatch(fail, "dispatch", got, want, num_valid)
    if handle.tokens_per_expert_list != want["tokens_per_expert"].tolist():
        fail(f"dispatch: tokens_per_expert_list {handle.tokens_per_expert_list}")
    if not grp.expand:  # each row's source: its rank by the prefix, its token by the index
        src_idx = handle.recv_src_idx.cpu()
        if not torch.equal(src_idx, eh.recv_src_idx.cpu()):
            fail(f"recv_src_idx {src_idx.tolist()}, reference {eh.recv_src_idx.tolist()}")
        prefix = handle.recv_rank_prefix.cpu().tolist()
        if prefix != torch.tensor(eh.recv_splits).cumsum(0).tolist():
            fail(f"recv_rank_prefix {prefix}, reference rows per rank {eh.recv_splits}")
    # expert_recv_stats: every rank's valid slots on this rank's experts (dropped rows too).
    expected = index + reference.tokens_routed_per_local_expert(group, _to(idx, dev), num_experts)
    if not torch.equal(stats.cpu(), expected):
        fail(f"expert_recv_stats {stats.tolist()}, expected {expected.tolist()}")
    # Each token crosses the network once per other node that holds one of its experts.
    pairs = _token_node_pairs(idx, num_experts // world, buf.ranks_per_node, rank)
    if buf.network_rows - sent_before != pairs:
        fail(
            f"{buf.network_rows - sent_before} rows crossed the network, not the {pairs} "
            "distinct (token, other node) pairs"
        )

    # check(): OverflowError with the real row count exactly when rows were dropped.
    try:
        buf.check(handle)
        if max_recv is not None and needed > max_recv:
            fail(f"check() did not raise OverflowError ({needed} rows needed, M={max_recv})")
    except OverflowError as e:
        if max_recv is None or needed <= max_recv:
            fail(f"check() raised OverflowError although nothing was dropped: {e}")
        elif f"needed {needed} rows" not in str(e):
            fail(f"check()'s OverflowError does not name the {needed} rows needed: {e}")

    def combines(what, h, rh, recv_w, ref_w):
        y = _to(_rows(num_rows, hidden, dtype, gen, case.strided), dev)  # [N, H] like recv_x
        if not grp.expand and recv_w is not None:  # a factor per row: its slots' weights
            recv_w, ref_w = recv_w.sum(dim=1), ref_w.sum(dim=1)
        for mode in case.combine:
            weights, ref_weights = (recv_w, ref_w) if mode == "recv" else (None, None)
            weights, ref_weights = _to(weights, dev), _to(ref_weights, dev)
            out = buf.combine(y, h, weights=weights).cpu()
            want = reference.combine(group, y, rh, weights=ref_weights).cpu()
            abs_w = None if ref_weights is None else ref_weights.abs()
            magnitude = reference.combine(group, y.float().abs(), rh, weights=abs_w).cpu()
            _check_combine(fail, f"{what} (weights={mode})", out, want, magnitude, idx, dtype)
        if not grp.expand and case.combine:  # per-slot values summed back, in the same launch
            values = _to(torch.randn(num_rows, case.topk, generator=gen), dev)
            out, summed = buf.combine(y, h, topk_weights=values)
            want_out, want_summed = reference.combine(group, y, rh, topk_weights=values)
            magnitude = reference.combine(group, y.float().abs(), rh).cpu()
            _check_combine(
                fail, f"{what} with topk_weights", out.cpu(), want_out.cpu(), magnitude, idx, dtype
            )
            if not torch.allclose(summed.cpu(), want_summed.cpu(), rtol=1e-6, atol=1e-6):
                fail(
                    f"{what}: combined topk_weights {summed.tolist()}, reference "
                    f"{want_summed.tolist()}"
                )

    combines("combine", handle, eh, got["recv_weights"], want["recv_weights"])

    if case.cached:  # new rows and weights along the same handle
        x2 = _rows(num_tokens, hidden, dtype, gen, case.strided)
        w2 = torch.rand(num_tokens, case.topk, generator=gen) if case.with_weights else None
        want2, eh2 = ref_dispatch(x2, w2, max_recv)
        sent_before = buf.network_rows
        got2, handle2 = buf_dispatch(x2, w2, handle=handle)
        _check_dispatch(fail, "cached dispatch", got2, want2, num_valid)
        if buf.network_rows - sent_before != pairs:
            fail(
                f"cached dispatch: {buf.network_rows - sent_before} rows crossed the network, "
                f"not {pairs}"
            )
        combines(
            "combine after cached dispatch",
            handle2,
            eh2,
            got2["recv_weights"],
            want2["recv_weights"],
        )


def _token_node_pairs(idx: torch.Tensor, local: int, ranks_per_node: int, rank: int) -> int:
    """Distinct (token, node other than this rank's) pairs of ``idx``'s valid slots."""
    nodes = torch.where(idx >= 0, idx // local // ranks_per_node, -1)
    others = (nodes >= 0) & (nodes != rank // ranks_per_node)
    return sum(len(set(row[keep].tolist())) for row, keep in zip(nodes, others, strict=True))


def _rank_body(rank: int, world_size: int, grp: Group) -> list[str]:
    """Run the group's cases in order on one Buffer; return this rank's failure messages."""
    failures: list[str] = []
    buf = Buffer(
        None,
        hidden_size=grp.hidden,
        max_tokens_per_rank=MAX_TOKENS,
        num_experts=grp.num_experts,
        dtype=grp.dtype,
        expand=grp.expand,
        ranks_per_node=grp.ranks_per_node,
        device=rank_device(),
    )
    try:
        for index, case in enumerate(grp.cases):
            prefix = f"[{grp.id} case {case.name!r}] rank {rank}:"

            def fail(msg: str, prefix=prefix) -> None:
                failures.append(f"{prefix} {msg}")

            try:
                _run_case(buf, rank, world_size, grp, index, case, fail)
            except Exception as e:  # ranks may be out of step now: stop here
                fail(raised(e))
                break
    finally:
        buf.destroy()
    return failures


def _quick(g: Group) -> bool:
    """In ``nox -s quick``: the bf16 groups of two ranks (expert rows, token rows, two nodes)."""
    return g.world_size <= 2 and g.dtype == BF16


@pytest.mark.parametrize(
    "grp",
    [
        *(
            g if _quick(g) else pytest.param(g, marks=pytest.mark.slow)
            for g in GROUPS + NODE_GROUPS
        ),
        *(pytest.param(g, marks=pytest.mark.gpu) for g in ONE_RANK_GROUPS),
    ],
    ids=lambda g: g.id,
)
def test_dispatch_combine_match_reference(launch, grp):
    results = launch(_rank_body, grp.world_size, grp)
    assert_no_failures(results)
