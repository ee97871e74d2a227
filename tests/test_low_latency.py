"""The low-latency mode (``Buffer.low_latency_dispatch`` / ``low_latency_combine``, DeepEP V1's
calls) against the plain-torch ``reference.low_latency_dispatch`` / ``low_latency_combine``.

Dispatch must match the reference bit for bit on the rows it specifies: recv_count, the rows
[0, recv_count[e]) of every local expert (bf16 rows, or FP8 values and their scales in DeepEP's
layouts: float32, power-of-two with round_scale, UE8M0 bytes packed four to an int32), the
handle's src_info (valid rows), layout_range and token_slots (valid slots), and what it adds into
cumulative_local_expert_recv_stats. Rows past recv_count are not specified and not compared.
Combine is compared with a tolerance of about two bf16 ulps of the summed terms' magnitude
(sum over a token's slots of |weight * y|), as tests/test_dispatch_combine.py does; a token
without a valid slot must be exactly zero. Some cases instead run a whole expert-parallel layer
(each expert scales its rows by its global id + 1) and compare with the layer computed from the
tokens alone, without any layout.

The reference takes every rank's inputs, so each rank draws all ranks' inputs from shared seeds
(group, case, rank, draw) and computes its reference locally. Every launch builds ONE Buffer
and runs a list of cases on it in sequence (that sequence is itself the repeated-call test:
T, K, M', the routing, the format, hooks, zero-copy and out= change from call to call); every
rank returns a list of failure messages.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from conftest import DEVICE, assert_no_failures, raised, skip_if_a_killed_rank_shares_a_gpu
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybrid_ep_triton import Buffer, reference
from hybrid_ep_triton.kernels.control import LL_REFUSED_RANGE, LL_SEQ
from hybrid_ep_triton.ops.low_latency import LowLatencyHandle
from hybrid_ep_triton.ops.masks import farewell
from hybrid_ep_triton.runtime.planner import deepep_low_latency_bytes
from hybrid_ep_triton.tools.launcher import RankFailure, rank_device

BF16, I32, I64 = torch.bfloat16, torch.int32, torch.int64
TOL = 2e-2  # bf16: |out - ref| <= TOL * (1 + sum over slots of |weight * y|)
FP8_GROUP = 128
# Flags of low_latency_dispatch per row format.
FORMATS = {
    "bf16": dict(use_fp8=False),
    "fp8": dict(use_fp8=True),
    "fp8_round": dict(use_fp8=True, round_scale=True),
    "ue8m0": dict(use_fp8=True, round_scale=True, use_ue8m0=True),
}


@dataclass(frozen=True)
class Case:
    """One low-latency dispatch (or two) and its combine(s) on the group's Buffer.

    tokens: T of rank r is tokens[r % len(tokens)] (at most M').
    mp: num_max_dispatch_tokens_per_rank M' (None: the Buffer's low_latency_tokens).
    hot_expert: every token names this global expert (in a random slot).
    unused_prob: chance that a slot is -1; with it, one token per rank has only -1 slots.
    fmt: a key of FORMATS.
    hook: "none", "dispatch" (its receive by hook), "combine", "both"; "pair": two dispatches
        await their hooks (the second with new tokens and routing), then both hooks, then two
        combines awaiting theirs, then both hooks.
    layer: y = each expert's recv rows times (its global id + 1), compared with the layer
        computed from the tokens; else y is random (rows past recv_count too).
    zero_copy: y is written into get_next_low_latency_combine_buffer's buffer.
    out: combine writes into a given tensor (prefilled with NaN).
    stats: the dispatch adds into cumulative_local_expert_recv_stats.
    async_finish: passed to both calls (on CPU ranks the event must be None).
    strided: x and y are column slices of wider tensors (row stride > H, storage offset > 0).
    probe_hooks: with hook="pair": a third call while two await hooks is a ValueError on every
        rank, and a hook called twice is a RuntimeError.
    """

    name: str
    tokens: tuple[int, ...] = (3, 5, 2, 4)
    mp: int | None = None
    topk: int = 2
    idx_dtype: torch.dtype = I64
    unused_prob: float = 0.0
    hot_expert: int | None = None
    fmt: str = "bf16"
    hook: str = "none"
    layer: bool = False
    zero_copy: bool = False
    out: bool = False
    stats: bool = False
    async_finish: bool = False
    strided: bool = False
    probe_hooks: bool = False


@dataclass(frozen=True)
class Group:
    """The cases run in order on one Buffer of one launch of world_size ranks."""

    world_size: int
    hidden: int
    num_experts: int
    tokens: int  # the Buffer's low_latency_tokens M
    seed: int
    cases: tuple[Case, ...]
    ranks_per_node: int | None = None
    first_seq: int = 0  # the sequence number the Buffer's calls count on from

    @property
    def id(self) -> str:
        nodes = ""
        if self.ranks_per_node is not None:
            nodes = f"-{self.world_size // self.ranks_per_node}x{self.ranks_per_node}"
        seq = f"-from{self.first_seq:#x}" if self.first_seq else ""
        return f"W{self.world_size}{nodes}-H{self.hidden}-E{self.num_experts}-M{self.tokens}{seq}"


# W=2, E=8: 4 local experts, M=6. Every feature once; FP8 needs H % 128 == 0.
MAIN = Group(
    2,
    256,
    8,
    6,
    seed=1,
    cases=(
        Case("basic", tokens=(3, 5)),
        Case("fp8", tokens=(6, 4), topk=3, stats=True),
        Case(
            "fp8_round_scale_int32_strided",
            tokens=(5, 2),
            idx_dtype=I32,
            fmt="fp8_round",
            strided=True,
        ),
        Case("ue8m0_unused_slots", tokens=(4, 6), topk=3, unused_prob=0.3, fmt="ue8m0"),
        Case(
            "hooks_zero_copy_out", tokens=(2, 5), hook="both", zero_copy=True, out=True, stats=True
        ),
        Case(
            "two_dispatches_await_hooks",
            tokens=(4, 3),
            hook="pair",
            unused_prob=0.2,
            probe_hooks=True,
        ),
        Case("empty_rank_layer", tokens=(0, 6), topk=2, layer=True),
        Case("all_ranks_empty", tokens=(0,), fmt="fp8", stats=True),
        Case("hot_expert_k1_mp_less_than_m_full", tokens=(3,), mp=3, topk=1, hot_expert=5),
        Case("k8_every_expert_fp8_layer", tokens=(3, 4), topk=8, fmt="fp8", layer=True),
        Case(
            "combine_hook_async_strided",
            tokens=(5, 1),
            hook="combine",
            async_finish=True,
            out=True,
            strided=True,
        ),
        Case("mp1", tokens=(1, 0), mp=1, topk=4, idx_dtype=I32, fmt="ue8m0", zero_copy=True),
        Case(
            "after_mp1_all_slots_maybe_unused",
            tokens=(6, 6),
            topk=3,
            unused_prob=0.6,
            fmt="fp8_round",
            hook="dispatch",
        ),
    ),
)
# Sequence numbers past 32 bits (as if the group had made 2^32 - 3 calls): a flag's number
# must not wrap where the calls cross 2^31 and 2^32.
PAST_32_BITS = Group(
    2,
    256,
    8,
    6,
    seed=13,
    first_seq=2**32 - 3,
    cases=(
        Case("basic", tokens=(3, 5), topk=3),
        Case("fp8_pair", tokens=(4, 6), fmt="fp8", hook="pair", unused_prob=0.2),
        Case("ue8m0_layer", tokens=(6, 2), topk=4, fmt="ue8m0", layer=True),
    ),
)
# Two simulated nodes of one rank: every row to the peer goes by a network put.
NODES_2X1 = Group(
    2,
    128,
    4,
    4,
    seed=8,
    ranks_per_node=1,
    cases=(
        Case("fp8_unused", tokens=(4, 3), topk=3, unused_prob=0.3, fmt="fp8", stats=True),
        Case("pair_zero_copy", tokens=(2, 4), hook="pair", zero_copy=True, out=True),
        Case("ue8m0_hot_layer", tokens=(3, 0), hot_expert=3, fmt="ue8m0", layer=True, hook="both"),
    ),
)
SLOW_GROUPS = [
    # Hidden sizes that are no multiple of 128 (bf16 only): 72, and 100 (200-byte rows).
    Group(
        2,
        72,
        4,
        5,
        seed=2,
        cases=(
            Case("basic", tokens=(5, 3)),
            Case(
                "hooks_zero_copy_layer",
                tokens=(2, 5),
                topk=3,
                hook="both",
                zero_copy=True,
                layer=True,
                stats=True,
            ),
            Case(
                "hot_expert_unused_int32",
                tokens=(4, 5),
                topk=2,
                hot_expert=0,
                unused_prob=0.3,
                idx_dtype=I32,
                out=True,
            ),
            Case("pair", tokens=(3, 0), topk=4, hook="pair"),
            Case("empty_mp2", tokens=(0, 2), mp=2, topk=1),
        ),
    ),
    Group(
        2,
        100,
        8,
        4,
        seed=3,
        cases=(
            Case(
                "k8_unused_strided", tokens=(4, 3), topk=8, unused_prob=0.3, out=True, strided=True
            ),
            Case("hot_layer_hook", tokens=(4, 4), hot_expert=1, layer=True, hook="dispatch"),
            Case("pair_zero_copy", tokens=(2, 4), topk=3, hook="pair", zero_copy=True),
        ),
    ),
    # H=384: three scale groups, so UE8M0's int32 holds three exponents and a pad byte.
    Group(
        2,
        384,
        4,
        4,
        seed=4,
        cases=(
            Case("ue8m0", tokens=(4, 3), topk=2, fmt="ue8m0", stats=True),
            Case("fp8_hot_layer", tokens=(3, 4), topk=3, hot_expert=2, fmt="fp8", layer=True),
            Case("fp8_round_pair", tokens=(4, 2), fmt="fp8_round", hook="pair", out=True),
            Case(
                "ue8m0_layer_zero_copy",
                tokens=(2, 4),
                topk=4,
                fmt="ue8m0",
                layer=True,
                zero_copy=True,
                hook="combine",
            ),
        ),
    ),
    # W=4, E=8: 2 local experts, so K=3..8 exceed one rank's experts.
    Group(
        4,
        128,
        8,
        4,
        seed=5,
        cases=(
            Case("basic", tokens=(3, 4, 1, 2)),
            Case(
                "fp8_k3_unused", tokens=(4, 0, 2, 3), topk=3, unused_prob=0.3, fmt="fp8", stats=True
            ),
            Case(
                "fp8_round_pair_probe",
                tokens=(2, 4, 3, 1),
                fmt="fp8_round",
                hook="pair",
                probe_hooks=True,
            ),
            Case(
                "ue8m0_hot_hooks_zero_copy",
                tokens=(4, 4, 0, 4),
                topk=4,
                hot_expert=6,
                fmt="ue8m0",
                hook="both",
                zero_copy=True,
            ),
            Case("all_empty", tokens=(0,), hook="both"),
            Case(
                "k8_layer_out_int32",
                tokens=(2, 1, 4, 3),
                topk=8,
                idx_dtype=I32,
                layer=True,
                out=True,
                unused_prob=0.2,
            ),
            Case("mp2_full", tokens=(2,), mp=2, topk=2, fmt="fp8", layer=True, stats=True),
        ),
    ),
    # Two simulated nodes of two ranks: rows to the other node go by network puts.
    Group(
        4,
        256,
        16,
        4,
        seed=6,
        ranks_per_node=2,
        cases=(
            Case("basic", tokens=(4, 2, 3, 1), topk=3),
            Case(
                "fp8_unused_stats",
                tokens=(3, 4, 0, 2),
                topk=4,
                unused_prob=0.3,
                fmt="fp8",
                stats=True,
            ),
            Case("ue8m0_pair", tokens=(2, 3, 4, 1), fmt="ue8m0", hook="pair"),
            Case(
                "hot_remote_node_layer",
                tokens=(4,),
                topk=2,
                hot_expert=13,
                layer=True,
                hook="both",
                zero_copy=True,
            ),
            Case(
                "fp8_round_k8_int32_out_strided",
                tokens=(1, 0, 4, 3),
                topk=8,
                idx_dtype=I32,
                fmt="fp8_round",
                out=True,
                strided=True,
            ),
            Case("all_empty", tokens=(0,), fmt="fp8"),
        ),
    ),
    # One rank: every row stays on the rank.
    Group(
        1,
        128,
        4,
        4,
        seed=7,
        cases=(
            Case("basic", tokens=(4,), topk=2),
            Case("fp8_pair", tokens=(3,), topk=4, fmt="fp8", hook="pair", probe_hooks=True),
            Case("empty_ue8m0", tokens=(0,), fmt="ue8m0"),
            Case(
                "layer_zero_copy_hooks",
                tokens=(4,),
                topk=3,
                unused_prob=0.3,
                layer=True,
                hook="both",
                zero_copy=True,
                stats=True,
            ),
        ),
    ),
]
# Long lists: many rows of one (expert, source), and at M' * K = 1088 more routing entries
# than a sender scans at a time (1024).
LONG_LISTS = Group(
    2,
    128,
    8,
    136,
    seed=10,
    cases=(
        Case("hot_fp8", tokens=(136, 70), topk=8, hot_expert=6, fmt="fp8"),
        Case(
            "unused_pair_zero_copy",
            tokens=(40, 136),
            topk=8,
            unused_prob=0.3,
            hook="pair",
            zero_copy=True,
            stats=True,
        ),
        Case(
            "hot_mp33_ue8m0_layer",
            tokens=(33,),
            mp=33,
            topk=2,
            hot_expert=1,
            fmt="ue8m0",
            layer=True,
            hook="both",
        ),
    ),
)
# GPUs only: DeepSeek-V3's hidden size, top-8 of 32 experts, up to 128 tokens a call (on CPU
# ranks the groups above cover the same code at sizes the interpreter can afford).
GPU_GROUPS = [
    Group(
        1,
        7168,
        32,
        128,
        seed=9,
        cases=(
            Case("bf16", tokens=(128,), topk=8),
            Case("fp8_unused_stats", tokens=(100,), topk=8, unused_prob=0.2, fmt="fp8", stats=True),
            Case(
                "fp8_round_pair_probe",
                tokens=(64,),
                mp=64,
                topk=8,
                fmt="fp8_round",
                hook="pair",
                probe_hooks=True,
            ),
            Case(
                "ue8m0_hot_layer_zero_copy",
                tokens=(128,),
                topk=8,
                hot_expert=5,
                fmt="ue8m0",
                layer=True,
                hook="both",
                zero_copy=True,
            ),
            Case("empty", tokens=(0,), fmt="fp8"),
            Case(
                "k1_int32_strided_out_async",
                tokens=(17,),
                mp=32,
                topk=1,
                idx_dtype=I32,
                strided=True,
                out=True,
                async_finish=True,
            ),
        ),
    ),
    # Two ranks at DeepSeek-V3's hidden size: two column slices a row, each its own flag.
    Group(
        2,
        7168,
        32,
        64,
        seed=11,
        cases=(
            Case("bf16", tokens=(64, 40), topk=8),
            Case("ue8m0_pair", tokens=(33, 64), topk=8, unused_prob=0.2, fmt="ue8m0", hook="pair"),
            Case(
                "fp8_hot_layer_zero_copy",
                tokens=(64,),
                topk=8,
                hot_expert=20,
                fmt="fp8",
                layer=True,
                hook="both",
                zero_copy=True,
                stats=True,
            ),
        ),
    ),
    # Eight ranks in one node.
    Group(
        8,
        1024,
        64,
        16,
        seed=12,
        cases=(
            Case("bf16", tokens=(16, 3, 9, 0, 12, 16, 1, 7), topk=8),
            Case(
                "fp8_unused_pair",
                tokens=(5, 16, 0, 8),
                topk=6,
                unused_prob=0.3,
                fmt="fp8",
                hook="pair",
                stats=True,
            ),
            Case(
                "ue8m0_hot_layer",
                tokens=(16,),
                topk=4,
                hot_expert=41,
                fmt="ue8m0",
                layer=True,
                hook="both",
                zero_copy=True,
            ),
        ),
    ),
]


# --- inputs --------------------------------------------------------------------------------


def _tokens(num: int, hidden: int, gen) -> torch.Tensor:
    """[num, hidden] bf16 with magnitudes that vary by 10^-6..10^3 between tokens and 128-channel
    groups (FP8's amax floor of 1e-4 and large scales), one group of zeros now and then."""
    groups = -(-hidden // FP8_GROUP)
    x = torch.randn(num, hidden, generator=gen)
    exponent = torch.randint(-6, 4, (num, groups), generator=gen).float()
    factor = (10.0**exponent).repeat_interleave(FP8_GROUP, dim=1)[:, :hidden]
    factor[
        torch.rand(num, groups, generator=gen).repeat_interleave(FP8_GROUP, 1)[:, :hidden] < 0.05
    ] = 0.0
    return (x * factor).to(BF16)


def _routing(num_tokens, num_experts, topk, unused_prob, hot, idx_dtype, gen) -> torch.Tensor:
    """[T, K] distinct global expert ids per row; -1 slots (one token with no valid slot when
    unused_prob > 0); with ``hot`` every token names that expert in a random slot."""
    idx = torch.rand(num_tokens, num_experts, generator=gen).argsort(dim=1)[:, :topk]
    if hot is not None and num_tokens:
        has_hot = idx == hot  # swap the hot expert into slot 0, keeping the ids distinct
        idx[has_hot] = idx[:, :1].expand_as(idx)[has_hot]
        idx[:, 0] = hot
        idx = idx.gather(1, torch.rand(num_tokens, topk, generator=gen).argsort(dim=1))
    if unused_prob:
        idx[torch.rand(num_tokens, topk, generator=gen) < unused_prob] = -1
        if num_tokens:
            idx[num_tokens // 2] = -1
    return idx.to(idx_dtype).contiguous()


def _inputs(grp: Group, index: int, case: Case, rank: int, draw: int):
    """x [T, H] bf16, topk_idx [T, K], topk_weights [T, K] float32 of ``rank`` (on the CPU)."""
    gen = torch.Generator().manual_seed(grp.seed * 1_000_000 + index * 1000 + draw * 100 + rank)
    num_tokens = case.tokens[rank % len(case.tokens)]
    x = _tokens(num_tokens, grp.hidden, gen)
    if case.strided:
        wide = torch.zeros(num_tokens, grp.hidden + 8, dtype=BF16)
        wide[:, 3 : 3 + grp.hidden] = x
        x = wide[:, 3 : 3 + grp.hidden]
    idx = _routing(
        num_tokens,
        grp.num_experts,
        case.topk,
        case.unused_prob,
        case.hot_expert,
        case.idx_dtype,
        gen,
    )
    weights = torch.rand(num_tokens, case.topk, generator=gen) * 2 - 0.5
    return x, idx, weights


def _expert_outputs(grp: Group, index: int, rank: int, draw: int, mp: int) -> torch.Tensor:
    """Random y [L, W * M', H] bf16 of ``rank`` (every row, also past the counts)."""
    gen = torch.Generator().manual_seed(
        grp.seed * 1_000_000 + index * 1000 + draw * 100 + 50 + rank
    )
    local = grp.num_experts // grp.world_size
    return torch.randn(local, grp.world_size * mp, grp.hidden, generator=gen).to(BF16)


# --- checks --------------------------------------------------------------------------------


def _rows_differ(got: torch.Tensor, want: torch.Tensor) -> list[int]:
    bad = got != want
    while bad.dim() > 1:
        bad = bad.any(dim=-1)
    return bad.nonzero().flatten().tolist()


def _dequantize(values: torch.Tensor, scales: torch.Tensor, fmt: str) -> torch.Tensor:
    """float32 [L, N, H] of FP8 rows as the library returns them (scales in either layout)."""
    num_local, rows, hidden = values.shape
    groups = hidden // FP8_GROUP
    if fmt == "ue8m0":
        words = scales.long()
        exponent = torch.stack([(words >> (8 * i)) & 0xFF for i in range(4)], dim=-1)
        exponent = exponent.reshape(num_local, rows, -1)[:, :, :groups]
        scales = ((exponent.to(I32)) << 23).view(torch.float32)
    blocks = values.float().reshape(num_local, rows, groups, FP8_GROUP)
    return (blocks * scales[:, :, :, None]).reshape(num_local, rows, hidden)


def _check_dispatch(fail, what, got, want, case: Case, grp: Group, mp: int) -> None:
    """Bit-exact comparison of one dispatch's outputs (valid rows) with the reference."""
    recv_x, recv_count, handle = got
    world, hidden = grp.world_size, grp.hidden
    local, rows = grp.num_experts // world, world * mp
    if recv_count.dtype != I32 or tuple(recv_count.shape) != (local,):
        fail(
            f"{what}: recv_count is {tuple(recv_count.shape)} {recv_count.dtype}, not [{local}] "
            "int32"
        )
        return
    if not torch.equal(recv_count, want.recv_count):
        fail(f"{what}: recv_count {recv_count.tolist()}, reference {want.recv_count.tolist()}")
        return
    valid = torch.arange(rows)[None, :] < want.recv_count[:, None]  # [L, W * M']

    if not isinstance(handle, LowLatencyHandle):
        fail(f"{what}: handle is a {type(handle).__name__}")
        return
    if (handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_experts) != (
        mp,
        hidden,
        grp.num_experts,
    ):
        fail(f"{what}: handle's (M', hidden, num_experts) = {tuple(handle[2:5])}")
    src = handle.src_info.cpu()
    if src.dtype != I32 or tuple(src.shape) != (local, rows):
        fail(f"{what}: src_info is {tuple(src.shape)} {src.dtype}, not [{local}, {rows}] int32")
    elif not torch.equal(src[valid], want.src_info[valid]):
        fail(f"{what}: src_info of the valid rows differs from the reference")
    layout = handle.layout_range.cpu()
    if layout.dtype != I64 or not torch.equal(layout, want.layout_range):
        fail(
            f"{what}: layout_range {layout.tolist()} ({layout.dtype}), reference "
            f"{want.layout_range.tolist()}"
        )
    slots = handle.token_slots.cpu()
    used = want.token_slots >= 0
    if slots.dtype != I32 or slots.shape != want.token_slots.shape:
        fail(f"{what}: token_slots is {tuple(slots.shape)} {slots.dtype}")
    elif not torch.equal(slots[used], want.token_slots[used]):
        fail(f"{what}: token_slots of the valid slots differ from the reference")

    if case.fmt == "bf16":
        if not isinstance(recv_x, torch.Tensor) or recv_x.dtype != BF16:
            fail(f"{what}: recv_x is {type(recv_x).__name__} {getattr(recv_x, 'dtype', '')}")
            return
        if tuple(recv_x.shape) != (local, rows, hidden):
            fail(f"{what}: recv_x is {tuple(recv_x.shape)}, not {(local, rows, hidden)}")
            return
        bad = _rows_differ(recv_x.cpu()[valid], want.recv_x[valid])
        if bad:
            fail(f"{what}: {len(bad)} of {int(valid.sum())} valid rows differ, first {bad[:8]}")
        return

    if not isinstance(recv_x, tuple) or len(recv_x) != 2:
        fail(
            f"{what}: with use_fp8 recv_x must be a (values, scales) pair, got "
            f"{type(recv_x).__name__}"
        )
        return
    values, scales = (t.cpu() for t in recv_x)
    if values.dtype != torch.float8_e4m3fn or tuple(values.shape) != (local, rows, hidden):
        fail(f"{what}: values are {tuple(values.shape)} {values.dtype}")
        return
    bad = _rows_differ(values.view(torch.uint8)[valid], want.values.view(torch.uint8)[valid])
    if bad:
        fail(
            f"{what}: FP8 values of {len(bad)} of {int(valid.sum())} valid rows differ, first "
            f"{bad[:8]}"
        )
    groups = hidden // FP8_GROUP
    cols = -(-groups // 4) if case.fmt == "ue8m0" else groups
    dtype = I32 if case.fmt == "ue8m0" else torch.float32
    layout = ((local, rows, cols), (cols * rows, 1, rows), dtype)
    if (tuple(scales.shape), scales.stride(), scales.dtype) != layout:
        fail(
            f"{what}: scales are {tuple(scales.shape)} strides {scales.stride()} "
            f"{scales.dtype}, not {layout}"
        )
        return
    if case.fmt == "ue8m0":  # the bytes of real groups (a pad byte past the last one is free)
        shifts = torch.tensor([8 * (g % 4) for g in range(groups)])
        got_bytes = (scales.long()[:, :, [g // 4 for g in range(groups)]] >> shifts) & 0xFF
        want_bytes = (want.scales.long()[:, :, [g // 4 for g in range(groups)]] >> shifts) & 0xFF
        bad = _rows_differ(got_bytes[valid], want_bytes[valid])
    else:
        bad = _rows_differ(scales.view(I32)[valid], want.scales.view(I32)[valid])
    if bad:
        fail(
            f"{what}: scales of {len(bad)} of {int(valid.sum())} valid rows differ, first {bad[:8]}"
        )


def _check_combine(fail, what, out, want, magnitude, topk_idx) -> None:
    if out.dtype != BF16 or out.shape != want.shape:
        fail(f"{what}: out is {tuple(out.shape)} {out.dtype}, reference {tuple(want.shape)}")
        return
    err = (out.float() - want.float()).abs()
    allowed = TOL * (1 + magnitude)
    bad = (~(err <= allowed)).any(dim=1).nonzero().flatten()  # NaN counts as bad
    if bad.numel():
        worst = torch.nan_to_num(err / allowed, nan=float("inf")).flatten().argmax()
        fail(
            f"{what}: {bad.numel()} of {out.shape[0]} tokens off the reference, first "
            f"{bad[:8].tolist()}; worst error {err.flatten()[worst]:.3g} > allowed "
            f"{allowed.flatten()[worst]:.3g}"
        )
    no_slot = (topk_idx < 0).all(dim=1)
    if (out[no_slot] != 0).any():
        fail(f"{what}: tokens without a valid slot are not zero: {no_slot.nonzero().tolist()}")


# --- rank body -----------------------------------------------------------------------------


def _wait(event) -> None:
    if event is not None:
        torch.cuda.current_stream().wait_event(event)


def _expect(fail, what: str, error: type, call, match: str | None = None) -> None:
    try:
        call()
    except error as e:
        if match is not None and match not in str(e):
            fail(f"{what}: {error.__name__} {str(e)!r} does not mention {match!r}")
    except Exception as e:
        fail(f"{what}: raised {e!r}, expected {error.__name__}")
    else:
        fail(f"{what}: did not raise {error.__name__}")


def _run_case(buf: Buffer, rank: int, grp: Group, index: int, case: Case, fail) -> None:
    dev, world = rank_device(), grp.world_size
    num_experts, local = grp.num_experts, grp.num_experts // grp.world_size
    mp = grp.tokens if case.mp is None else case.mp
    fmt = FORMATS[case.fmt]
    draws = 2 if case.hook == "pair" else 1
    inputs = [[_inputs(grp, index, case, j, d) for j in range(world)] for d in range(draws)]
    stats = torch.arange(local, dtype=I32) * 7 + index if case.stats else None
    stats_dev = None if stats is None else stats.to(dev)
    dispatch_hook = case.hook in ("dispatch", "both", "pair")
    combine_hook = case.hook in ("combine", "both", "pair")

    # --- dispatch (two awaiting their hooks with "pair") ---
    calls = []
    for d in range(draws):
        x, idx, _ = inputs[d][rank]
        recv_x, recv_count, handle, event, hook = buf.low_latency_dispatch(
            x.to(dev),
            idx.to(dev),
            mp,
            num_experts,
            cumulative_local_expert_recv_stats=stats_dev,
            async_finish=case.async_finish,
            return_recv_hook=dispatch_hook,
            **fmt,
        )
        if (hook is None) == dispatch_hook:
            fail(f"dispatch {d}: hook is {hook!r} with return_recv_hook={dispatch_hook}")
        if event is not None and (dev.type == "cpu" or not case.async_finish):
            fail(f"dispatch {d}: event {event!r} on {dev} with async_finish={case.async_finish}")
        calls.append([recv_x, recv_count, handle, event, hook])
    if case.probe_hooks:
        x, idx, _ = inputs[0][rank]
        _expect(
            fail,
            "a third call while two await their hooks",
            ValueError,
            lambda: buf.low_latency_dispatch(x.to(dev), idx.to(dev), mp, num_experts, **fmt),
            "hook",
        )
    for call in calls:
        if call[4] is not None:
            call[4]()
        _wait(call[3])
    if case.probe_hooks:
        _expect(fail, "a dispatch hook called twice", RuntimeError, calls[0][4])
    for d, (recv_x, recv_count, handle, _, _) in enumerate(calls):
        xs = [inputs[d][j][0] for j in range(world)]
        idxs = [inputs[d][j][1] for j in range(world)]
        want = reference.low_latency_dispatch(xs, idxs, num_experts, mp, rank, **fmt)
        if isinstance(recv_x, tuple):
            recv_x = tuple(t.cpu() for t in recv_x)
        elif isinstance(recv_x, torch.Tensor):
            recv_x = recv_x.cpu()
        calls[d][0] = recv_x
        calls[d].append(want)
        _check_dispatch(
            fail, f"dispatch {d}", (recv_x, recv_count.cpu(), handle), want, case, grp, mp
        )
        if stats is not None:
            stats += want.recv_count
    if stats is not None and not torch.equal(stats_dev.cpu(), stats):
        fail(f"cumulative_local_expert_recv_stats {stats_dev.tolist()}, expected {stats.tolist()}")

    # --- combine(s): two awaiting their hooks with "pair" ---
    pending = []
    for d, (recv_x, _, handle, _, _, want) in enumerate(calls):
        x, idx, w = inputs[d][rank]
        if case.layer:  # expert e's output: its rows times (global id + 1), from recv_x
            factor = torch.arange(rank * local, (rank + 1) * local) + 1.0
            rows = _dequantize(*recv_x, case.fmt) if case.fmt != "bf16" else recv_x.float()
            y = (rows * factor[:, None, None]).to(BF16)
        else:
            y = _expert_outputs(grp, index, rank, d, mp)
        out = None
        if case.out:
            out = torch.full((x.shape[0], grp.hidden), float("nan"), dtype=BF16, device=dev)
        y_dev = y.to(dev)
        if case.strided:
            wide = torch.zeros(*y.shape[:2], grp.hidden + 6, dtype=BF16, device=dev)
            wide[:, :, 2 : 2 + grp.hidden] = y_dev
            y_dev = wide[:, :, 2 : 2 + grp.hidden]
        if case.zero_copy:
            y_dev = buf.get_next_low_latency_combine_buffer(handle)
            if (tuple(y_dev.shape), y_dev.dtype) != (tuple(y.shape), BF16):
                fail(
                    f"combine buffer is {tuple(y_dev.shape)} {y_dev.dtype}, not "
                    f"{tuple(y.shape)} bf16"
                )
                return
            y_dev.copy_(y)
        got, event, hook = buf.low_latency_combine(
            y_dev,
            idx.to(dev),
            w.to(dev),
            handle,
            zero_copy=case.zero_copy,
            async_finish=case.async_finish,
            return_recv_hook=combine_hook,
            out=out,
        )
        if (hook is None) == combine_hook:
            fail(f"combine {d}: hook is {hook!r} with return_recv_hook={combine_hook}")
        if out is not None and got.data_ptr() != out.data_ptr():
            fail(f"combine {d}: returned another tensor than out=")
        pending.append((d, got, event, hook, x, idx, w, y, want))
    for _, _, event, hook, *_ in pending:
        if hook is not None:
            hook()
        _wait(event)
    if case.probe_hooks:
        _expect(fail, "a combine hook called twice", RuntimeError, pending[0][3])

    for d, got, _, _, x, idx, w, _, _ in pending:
        what = f"combine {d}"
        ids = idx.long()
        if case.layer:  # sum over valid slots of w * (expert + 1) * (the expert's input row)
            rows = x.float()
            if case.fmt != "bf16":
                q = reference.quantize_fp8_low_latency(x, fmt.get("round_scale", False))
                rows = reference.dequantize_fp8(*q) if x.shape[0] else rows
            terms = torch.where(ids >= 0, w * (ids + 1), 0.0)  # [T, K]
            ref = (terms.sum(dim=1, keepdim=True) * rows).to(BF16)
            magnitude = terms.abs().sum(dim=1, keepdim=True) * rows.abs()
            what += " (layer)"
        else:
            ys = [_expert_outputs(grp, index, j, d, mp) for j in range(world)]
            idxs = [inputs[d][j][1] for j in range(world)]
            ref = reference.low_latency_combine(ys, idxs, w, num_experts, rank)
            abs_ys = [t.float().abs() for t in ys]
            magnitude = reference.low_latency_combine(abs_ys, idxs, w.abs(), num_experts, rank)
        _check_combine(fail, what, got.cpu(), ref, magnitude.float(), ids)


def _rank_body(rank: int, world_size: int, grp: Group) -> list[str]:
    """Run the group's cases in order on one Buffer; return this rank's failure messages."""
    failures: list[str] = []
    buf = Buffer(
        None,
        hidden_size=grp.hidden,
        max_tokens_per_rank=max(grp.tokens, 1),
        num_experts=grp.num_experts,
        low_latency_tokens=grp.tokens,
        ranks_per_node=grp.ranks_per_node,
        device=rank_device(),
        timeout_s=60.0,
    )
    if grp.first_seq:
        _count_from(buf, grp.first_seq)
    try:
        for index, case in enumerate(grp.cases):
            prefix = f"[{grp.id} case {case.name!r}] rank {rank}:"

            def fail(msg: str, prefix=prefix) -> None:
                failures.append(f"{prefix} {msg}")

            try:
                _run_case(buf, rank, grp, index, case, fail)
                buf.check()
            except Exception as e:  # ranks may be out of step now: stop here
                fail(raised(e))
                break
    finally:
        buf.destroy()
    return failures


def _count_from(buf: Buffer, seq: int) -> None:
    """Set every rank's low-latency state as if the group's last call had number ``seq`` and
    every rank's receive of it were over (the control block's LL_SEQ, the heap's ll_freed);
    every rank, then a barrier before any call (a peer's call writes into these words)."""
    rt = buf._rt
    rt.control[int(LL_SEQ)] = seq
    freed = rt.plan.heap.ll_freed
    rt.heap.local[freed : freed + 8 * rt.world_size].view(torch.int64).fill_(seq)
    if rt.control.is_cuda:  # (written on this stream; the calls run on the Buffer's)
        torch.cuda.synchronize(rt.control.device)
    dist.barrier()


@pytest.mark.parametrize(
    "grp",
    [
        MAIN,
        NODES_2X1,
        PAST_32_BITS,
        *(pytest.param(g, marks=pytest.mark.slow) for g in [*SLOW_GROUPS, LONG_LISTS]),
        *(pytest.param(g, marks=pytest.mark.gpu) for g in GPU_GROUPS),
    ],
    ids=lambda g: g.id,
)
def test_low_latency_matches_reference(launch, grp):
    assert_no_failures(launch(_rank_body, grp.world_size, grp))


# --- masked ranks --------------------------------------------------------------------------

# W=4 in one node and as 2 nodes of 2, E=8, M=6: rank MASKED creates the Buffer and makes no
# call; the others mask it (by hand, or as their first call's waits on it run out) and run these
# cases, whose reference has no tokens of its and no experts on it.
MASKED = 2
# The live ranks' timeout_s where they mask the stalled rank themselves: well above the longest
# a live peer can keep them waiting without a heartbeat (a waiting rank beats; one running a
# launch's programs, or building kernels, does not), or they mask it too: on CPU ranks a launch
# of 4 interpreted ranks on a loaded 2-core machine takes seconds; on GPUs kernel builds,
# seconds each.
STALL_TIMEOUT_S = 25.0 if DEVICE == "cpu" else 90.0
MASKED_GROUPS = [
    Group(
        4,
        256,
        8,
        6,
        seed=7,
        ranks_per_node=rpn,
        cases=(
            Case("bf16", tokens=(3, 6, 5, 0), topk=3, unused_prob=0.2),
            Case(
                "fp8_hot_expert_on_the_masked_rank",
                tokens=(6, 2, 4, 5),
                topk=2,
                fmt="fp8",
                hot_expert=5,
            ),
            Case("ue8m0_hooks", tokens=(0, 4, 6, 3), topk=4, fmt="ue8m0", hook="both"),
        ),
    )
    for rpn in (None, 2)
]


def _masked_body(
    rank: int,
    world: int,
    grp: Group,
    how: str,
    stall_at: int = 0,
    rounds: int = 1,
    lag_s: float = 0.0,
) -> list[str]:
    """Rank MASKED makes the Buffer and the first ``stall_at`` calls (a case is a dispatch and
    a combine), then makes no more (``how``: "by hand", "told", "stalled", "clean": the others
    call clean_low_latency_buffer after the first case) or is killed ("killed"). Every other
    rank masks it (by hand; "told": rank 0 by hand, and the others as rank 0's first launch
    tells them; else with mask_failed_ranks when its waits on it run out)
    and runs the group's cases ``rounds`` times, with fresh inputs, against the reference
    without it from the call it missed; the API's checks on the way. Rank 0 lags ``lag_s``
    seconds after its first case (a live rank late for the others' next call while they waited
    on MASKED). "killed": a live rank raises its failures (the launcher reports only failed
    ranks once one has died)."""
    # (masked by a live rank: the masked rank, alive, waits for the others, checks that it
    # was told, and frees the heap with them)
    masked_by_hand = how in ("by hand", "told")
    failures: list[str] = []
    buf = Buffer(
        None,
        hidden_size=grp.hidden,
        max_tokens_per_rank=grp.tokens,
        num_experts=grp.num_experts,
        low_latency_tokens=grp.tokens,
        ranks_per_node=grp.ranks_per_node,
        device=rank_device(),
        mask_failed_ranks=how in ("stalled", "killed", "clean"),
        timeout_s=60.0 if how in ("by hand", "told") else STALL_TIMEOUT_S,
    )
    dev, local = rank_device(), grp.num_experts // world

    def fail(msg: str) -> None:
        failures.append(f"[{grp.id} masked, {how} at call {stall_at}] rank {rank}: {msg}")

    cases = [
        (index, case)
        for index in range(rounds * len(grp.cases))
        for case in [grp.cases[index % len(grp.cases)]]
    ]
    if rank == MASKED:
        for index, case in cases[: -(-stall_at // 2)]:
            _masked_case(buf, rank, grp, index, case, local, fail, stall_at)
        if how == "killed":
            os.kill(os.getpid(), signal.SIGKILL)
        if masked_by_hand:  # once the others are done: they told this rank too
            dist.barrier()
            if buf.masked_ranks != [MASKED]:
                fail(f"the masked rank's own mask holds {buf.masked_ranks}")
            # (as the others do: with no mask, destroy() frees the heap with every rank)
            buf.clean_mask()
        buf.destroy()
        return failures
    try:
        _expect(fail, "masking this rank", ValueError, lambda: buf.update_mask(rank), "own rank")
        wrong = torch.zeros(world, dtype=I64, device=dev)
        _expect(fail, "a mask output of int64", ValueError, lambda: buf.query_mask(wrong), "int32")
        if how == "by hand" or (how == "told" and rank == 0):
            buf.update_mask(MASKED)
        for index, case in cases:
            _masked_case(buf, rank, grp, index, case, local, fail, stall_at)
            if index == 0 and rank == 0:
                time.sleep(lag_s)
            if index == 0 and how == "clean":
                buf.clean_low_latency_buffer(grp.tokens, grp.hidden, grp.num_experts)
                if buf.masked_ranks != [MASKED]:
                    fail(f"after the clean MASKED skipped, masked_ranks {buf.masked_ranks}")
            buf.check()
        mask = torch.full((world,), -1, dtype=I32, device=dev)
        buf.query_mask(mask)
        if mask.tolist() != [int(j == MASKED) for j in range(world)] or buf.masked_ranks != [
            MASKED
        ]:
            fail(f"query_mask {mask.tolist()}, masked_ranks {buf.masked_ranks}")
        buf.clean_mask()
        if buf.masked_ranks:
            fail(f"after clean_mask, masked_ranks {buf.masked_ranks}")
        if how == "killed":  # (so that destroy() does not wait timeout_s for the dead rank's
            buf.update_mask(MASKED)  # farewell)
    except Exception as e:
        fail(raised(e))
    finally:
        if masked_by_hand:
            dist.barrier()
        buf.destroy()
    if how == "killed" and failures:
        raise AssertionError("\n".join(failures))
    return failures


def _masked_case(buf, rank, grp, index, case, local, fail, stall_at) -> None:
    """One case (call 2 * index its dispatch, the next its combine), where rank MASKED makes
    the calls before ``stall_at`` only: the reference takes its tokens as none in a dispatch
    it missed, and drops the slots that name its experts from a combine it missed. MASKED
    itself checks nothing."""
    dev, world, mp, fmt = rank_device(), grp.world_size, grp.tokens, FORMATS[case.fmt]
    dispatched, combined = 2 * index < stall_at, 2 * index + 1 < stall_at
    inputs = [_inputs(grp, index, case, j, 0) for j in range(world)]
    x, idx, w = inputs[rank]
    hooks = case.hook == "both"
    recv_x, recv_count, handle, _, hook = buf.low_latency_dispatch(
        x.to(dev), idx.to(dev), mp, grp.num_experts, return_recv_hook=hooks, **fmt
    )
    if hook is not None:
        hook()
    xs = [t[:0] if j == MASKED and not dispatched else t for j, (t, _, _) in enumerate(inputs)]
    idxs = [t[:0] if j == MASKED and not dispatched else t for j, (_, t, _) in enumerate(inputs)]
    if rank != MASKED:
        want = reference.low_latency_dispatch(xs, idxs, grp.num_experts, mp, rank, **fmt)
        what = f"{case.name} {index}: dispatch"
        _check_dispatch(fail, what, (recv_x, recv_count.cpu(), handle), want, case, grp, mp)
    elif not combined:
        return
    y = _expert_outputs(grp, index, rank, 0, mp)
    got, _, hook = buf.low_latency_combine(
        y.to(dev), idx.to(dev), w.to(dev), handle, return_recv_hook=hooks
    )
    if hook is not None:
        hook()
    if rank == MASKED:
        return
    ys = [_expert_outputs(grp, index, j, 0, mp) for j in range(world)]
    alive = [
        t.long() if combined else torch.where(t.long() // local == MASKED, -1, t.long())
        for t in idxs
    ]
    ref = reference.low_latency_combine(ys, alive, w, grp.num_experts, rank)
    magnitude = reference.low_latency_combine(
        [t.float().abs() for t in ys], alive, w.abs(), grp.num_experts, rank
    )
    _check_combine(
        fail, f"{case.name} {index}: combine", got.cpu(), ref, magnitude.float(), alive[rank]
    )


@pytest.mark.parametrize("grp", MASKED_GROUPS, ids=lambda g: g.id)
def test_masked_rank_is_skipped(launch, grp):
    assert_no_failures(launch(_masked_body, grp.world_size, grp, "by hand"))


def test_a_mask_set_on_one_rank_reaches_the_others(launch):
    """Rank 0 masks MASKED by hand; the other live ranks, which neither mask it nor mask on a
    timeout, learn it from rank 0's first launch: their waits on MASKED end, without a
    TimeoutError, and their outputs equal the reference without it."""
    grp = MASKED_GROUPS[0]
    assert_no_failures(launch(_masked_body, grp.world_size, grp, "told"))


@pytest.mark.slow
@pytest.mark.parametrize(
    "stall_at, lag_s",
    [(0, 0.0), (1, 8.0)],
    ids=["before a dispatch", "between dispatch and combine"],
)
def test_rank_that_stops_answering_is_masked(launch, stall_at, lag_s):
    """mask_failed_ranks: the live ranks' waits on the stalled rank run out and mask it; that
    call and the 20 and more after it equal the reference without it, and no TimeoutError is
    raised. Between dispatch and combine, rank 3 has no tokens to combine, goes on and waits
    for rank 0, which waited on the stalled rank and then lags: rank 0's heartbeat keeps it
    from being masked too (without heartbeats rank 3 masks it)."""
    grp = MASKED_GROUPS[0]
    assert_no_failures(launch(_masked_body, grp.world_size, grp, "stalled", stall_at, 4, lag_s))


@pytest.mark.slow
def test_rank_that_skips_a_clean_is_masked(launch):
    """clean_low_latency_buffer is a barrier of the live ranks: the stalled rank, which made the
    first case's calls and then no clean, is masked there, as DeepEP's clean does."""
    grp = MASKED_GROUPS[0]
    assert_no_failures(launch(_masked_body, grp.world_size, grp, "clean", 2, 2))


@pytest.mark.slow
@pytest.mark.parametrize("grp", MASKED_GROUPS, ids=lambda g: g.id)
def test_rank_killed_outright_is_masked(launch, grp):
    """The same with the rank's process killed (SIGKILL) between its dispatch and its combine:
    the only failure the launcher reports is that rank's death. Across nodes the live ranks
    waiting on it keep the others of their node and of the other node from masking them too
    (heartbeats pushed across nodes)."""
    skip_if_a_killed_rank_shares_a_gpu(grp.world_size)
    with pytest.raises(RankFailure) as failed:
        launch(_masked_body, grp.world_size, grp, "killed", 1, 4, fresh=True, failure_grace_s=300)
    assert list(failed.value.failures) == [MASKED], failed.value.failures


def _farewell_body(rank: int, world: int, ranks_per_node, how: str) -> list[str]:
    """destroy()'s farewell: ``how`` "all": every rank comes, and each frees the heap with the
    others; "masked": rank 0 has masked rank 1 (not told yet: no call was made), and every
    rank leaves the heap; "silent": rank MASKED comes only once the others are done, and every
    rank leaves it, the others after timeout_s. Each rank's verdict, then destroy()."""
    buf = Buffer(
        None,
        hidden_size=128,
        max_tokens_per_rank=4,
        num_experts=8,
        low_latency_tokens=4,
        ranks_per_node=ranks_per_node,
        device=rank_device(),
        timeout_s=3.0 if how == "silent" else 60.0,
    )
    if how == "masked" and rank == 0:
        buf.update_mask(1)
    silent = how == "silent" and rank == MASKED
    if silent:
        dist.barrier()
    rt = buf._rt  # (internals: what destroy() decides)
    together = farewell(rt.heap, rt.rank, rt.world_size, rt.plan.nodes, rt.timeout_ns, rt.device)
    if how == "silent" and not silent:
        dist.barrier()
    buf.destroy()
    want = how == "all"
    return [] if together == want else [f"{how}: rank {rank} frees together: {together}"]


@pytest.mark.parametrize("ranks_per_node", [None, 2], ids=["W4", "2x2"])
@pytest.mark.parametrize("how", ["all", "masked", "silent"])
def test_destroy_frees_together_only_where_every_rank_says_so(launch, how, ranks_per_node):
    assert_no_failures(launch(_farewell_body, 4, ranks_per_node, how))


# --- refused inputs ------------------------------------------------------------------------

V_HIDDEN, V_EXPERTS, V_TOKENS = 128, 4, 4  # W=2: 2 local experts; low_latency_tokens 4


def _peer_refused(fail, what: str, bad_rank: int, steps) -> None:
    """A call whose inputs rank ``bad_rank``'s host refused, on a rank that passed valid ones:
    ``steps`` (the call, its hook if any, then check()) run in order, and exactly one raises a
    ValueError naming the bad rank (on CPU ranks the call itself, whose launch is synchronous;
    on GPUs check())."""
    raised = []
    for step in steps:
        try:
            step()
        except ValueError as e:
            raised.append(str(e))
        except Exception as e:
            fail(f"{what}: raised {e!r}, expected a ValueError naming rank {bad_rank}")
            return
    if len(raised) != 1:
        fail(f"{what}: {len(raised)} ValueErrors over the call and check(), not 1: {raised}")
    elif f"rank {bad_rank}" not in raised[0]:
        fail(f"{what}: the ValueError does not name rank {bad_rank}: {raised[0]!r}")


def _refused_on_one_rank(buf, rank, bad, what, fail, bad_call, good_call, match) -> None:
    """Rank ``bad`` makes ``bad_call``, which its host refuses (a ValueError naming ``match``);
    the others make ``good_call`` (returns its hook or None), which must finish, and then learn
    of the refusal once (``_peer_refused``)."""
    if rank == bad:
        _expect(fail, what, ValueError, bad_call, match)
        try:
            buf.check()  # its own refusal was its ValueError; clear anything recorded
        except ValueError:
            pass
        return
    hooks = []

    def run_hook() -> None:
        if hooks and hooks[0] is not None:
            hooks[0]()

    _peer_refused(fail, what, bad, [lambda: hooks.append(good_call()), run_hook, buf.check])


def _validation_body(rank: int, world: int, ranks_per_node: int | None) -> list[str]:
    failures: list[str] = []

    def fail(msg: str) -> None:
        failures.append(f"rank {rank}: {msg}")

    dev = rank_device()
    E, H, M = V_EXPERTS, V_HIDDEN, V_TOKENS
    local = E // world
    grp = Group(world, H, E, M, seed=20, cases=(), ranks_per_node=ranks_per_node)
    good = Case("good", tokens=(3, 2, 4, 2), topk=2)
    kw = dict(
        hidden_size=H,
        max_tokens_per_rank=M,
        num_experts=E,
        device=dev,
        timeout_s=30.0,
        ranks_per_node=ranks_per_node,
    )
    buf = Buffer(None, low_latency_tokens=M, **kw)
    index = 0

    def round_trip(name: str, **more) -> None:
        nonlocal index
        index += 1
        case = Case(f"after {name}", tokens=(3, 2, 4, 1), topk=2, **more)

        def tagged(msg: str) -> None:
            fail(f"round trip after {name}: {msg}")

        _run_case(buf, rank, grp, index, case, tagged)

    try:
        x, idx, w = (t.to(dev) for t in _inputs(grp, 0, good, rank, 0))
        stats = torch.zeros(local, dtype=I32, device=dev)

        def refused_by_all(what: str, call, match: str | None = None) -> None:
            """Every rank's host refuses: each raises its own ValueError; check() may then
            raise a ValueError naming a peer's refusal (after a refused dispatch it does, after
            a refused combine it does not: each rank heard of its own already), once; stats
            are untouched."""
            _expect(fail, what, ValueError, call, match)
            for n in range(2):
                try:
                    buf.check()
                except ValueError as e:
                    if n or "refused" not in str(e):
                        fail(f"check() {n + 1} after {what} raised {e!r}")
                except Exception as e:
                    fail(f"check() {n + 1} after {what} raised {e!r}")
            if stats.any():
                fail(f"{what}: a refused dispatch added into the stats: {stats.tolist()}")

        def dispatch(x_=x, idx_=idx, mp=M, num_experts=E, **more):
            more.setdefault("cumulative_local_expert_recv_stats", stats)
            return lambda: buf.low_latency_dispatch(x_, idx_, mp, num_experts, **more)

        refused_by_all("x with T > M'", dispatch(mp=1), "num_max_dispatch_tokens_per_rank")
        refused_by_all("M' > low_latency_tokens", dispatch(mp=M + 1), "<= 4")
        refused_by_all("M' = 0", dispatch(mp=0), "num_max_dispatch_tokens_per_rank")
        refused_by_all("num_experts not the Buffer's", dispatch(num_experts=2 * E), "num_experts")
        refused_by_all("use_ue8m0 without round_scale", dispatch(use_ue8m0=True), "use_ue8m0")
        no_fp8 = dispatch(use_fp8=False, round_scale=True, use_ue8m0=True)
        refused_by_all("use_ue8m0 without use_fp8", no_fp8, "use_ue8m0")
        refused_by_all("use_fp8=1", dispatch(use_fp8=1), "use_fp8")
        refused_by_all("x float32", dispatch(x_=x.float()), "x")
        refused_by_all("x of another hidden size", dispatch(x_=x[:, :64]), "x")
        refused_by_all("topk_idx float", dispatch(idx_=idx.float()), "topk_idx")
        refused_by_all(
            "topk_idx with a row too many", dispatch(idx_=torch.cat([idx, idx[:1]])), "topk_idx"
        )
        refused_by_all("topk_idx with K=0", dispatch(idx_=idx[:, :0]), "topk_idx")
        for name, bad_stats in (
            ("int64", stats.long()),
            ("[L + 1]", torch.zeros(local + 1, dtype=I32, device=dev)),
            ("on another device", stats.to("meta")),
        ):
            call = dispatch(cumulative_local_expert_recv_stats=bad_stats)
            refused_by_all(f"stats {name}", call, "cumulative_local_expert_recv_stats")
        round_trip("refused dispatches", fmt="fp8", hook="both", stats=True)

        _, _, handle, _, _ = buf.low_latency_dispatch(x, idx, M, E)
        buf.check()
        y = torch.randn(local, world * M, H, generator=torch.Generator().manual_seed(rank))
        y = y.to(BF16).to(dev)

        def combine(y_=y, idx_=idx, w_=w, handle_=handle, **more):
            return lambda: buf.low_latency_combine(y_, idx_, w_, handle_, **more)

        refused_by_all("y with a row too many", combine(y_=torch.cat([y, y[:, :1]], 1)), "x")
        refused_by_all("y float32", combine(y_=y.float()), "x")
        refused_by_all("topk_weights float64", combine(w_=w.double()), "topk_weights")
        refused_by_all(
            "topk_weights [T, K + 1]", combine(w_=torch.cat([w, w[:, :1]], 1)), "topk_weights"
        )
        refused_by_all(
            "topk_idx of another shape", combine(idx_=torch.cat([idx, idx[:1]])), "topk_idx"
        )
        for name, bad_out in (
            ("of another shape", torch.empty(x.shape[0] + 1, H, dtype=BF16, device=dev)),
            ("float32", torch.empty(x.shape[0], H, device=dev)),
            ("not contiguous", torch.empty(H, x.shape[0], dtype=BF16, device=dev).t()),
        ):
            refused_by_all(f"out {name}", combine(out=bad_out), "out")
        refused_by_all("a handle of another type", combine(handle_=object()), "handle")
        refused_by_all("zero_copy with another tensor", combine(zero_copy=True), "zero_copy")
        round_trip("refused combines", zero_copy=True, out=True)

        # One rank refuses, the others pass valid inputs: they finish (no hang) and learn of it.
        bad = world - 1
        too_many = torch.zeros(M + 1, H, dtype=BF16, device=dev)  # T > M' on the bad rank
        too_many_idx = torch.zeros(M + 1, 2, dtype=I64, device=dev)
        too_many_idx[:, 1] = 1
        for hook in (False, True):
            _refused_on_one_rank(
                buf,
                rank,
                bad,
                f"dispatch refused by rank {bad} (hook={hook})",
                fail,
                lambda hook=hook: buf.low_latency_dispatch(
                    too_many, too_many_idx, M, E, return_recv_hook=hook
                ),
                lambda hook=hook: buf.low_latency_dispatch(x, idx, M, E, return_recv_hook=hook)[4],
                "num_max_dispatch_tokens_per_rank",
            )
            more = dict(fmt="ue8m0", hook="both") if hook else {}
            round_trip(f"a dispatch refused by one rank (hook={hook})", **more)

            _, _, handle, _, _ = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)
            buf.check()
            _refused_on_one_rank(
                buf,
                rank,
                bad,
                f"combine refused by rank {bad} (hook={hook})",
                fail,
                lambda hook=hook, handle=handle: buf.low_latency_combine(
                    y, idx, w.double(), handle, return_recv_hook=hook
                ),
                lambda hook=hook, handle=handle: buf.low_latency_combine(
                    y, idx, w, handle, return_recv_hook=hook
                )[2],
                "topk_weights",
            )
            round_trip(
                f"a combine refused by one rank (hook={hook})",
                fmt="fp8",
                hook="dispatch" if hook else "combine",
                stats=True,
            )

        # Hooks: a third call while two await theirs; a hook called twice.
        first = buf.low_latency_dispatch(x, idx, M, E, return_recv_hook=True)[4]
        second = buf.low_latency_combine(y, idx, w, handle, return_recv_hook=True)[2]
        _expect(fail, "a combine while two calls await their hooks", ValueError, combine(), "hook")
        first()
        _expect(fail, "a dispatch hook called twice", RuntimeError, first)
        second()
        _expect(fail, "a combine hook called twice", RuntimeError, second)
        round_trip("the hook errors", hook="pair")
        buf.check()
        if not buf.low_latency_tokens == M:
            fail(f"Buffer.low_latency_tokens is {buf.low_latency_tokens}, not {M}")
    except Exception as e:
        fail(raised(e))
    finally:
        buf.destroy()

    # A Buffer without the low-latency mode: ValueError on calling.
    plain = Buffer(None, **kw)
    try:
        xs, idxs, ws = _inputs(grp, 0, good, rank, 0)
        _expect(
            fail,
            "low_latency_dispatch without low_latency_tokens",
            ValueError,
            lambda: plain.low_latency_dispatch(xs.to(dev), idxs.to(dev), M, E),
            "low_latency_tokens",
        )
        _expect(
            fail,
            "low_latency_combine without low_latency_tokens",
            ValueError,
            lambda: plain.low_latency_combine(y, idxs.to(dev), ws.to(dev), handle),
            "low_latency_tokens",
        )
        _expect(
            fail,
            "get_next_low_latency_combine_buffer without low_latency_tokens",
            ValueError,
            lambda: plain.get_next_low_latency_combine_buffer(handle),
            "low_latency_tokens",
        )
    finally:
        plain.destroy()

    # use_fp8 needs a hidden size that is a multiple of 128; bf16 works at 72.
    odd = Group(world, 72, E, M, seed=21, cases=(), ranks_per_node=ranks_per_node)
    buf = Buffer(None, low_latency_tokens=M, **{**kw, "hidden_size": 72})
    try:
        x72 = _inputs(odd, 0, good, rank, 0)[0].to(dev)
        _expect(
            fail,
            "use_fp8 at hidden 72",
            ValueError,
            lambda: buf.low_latency_dispatch(x72, idx, M, E, use_fp8=True),
            "128",
        )
        _expect(fail, "check() after use_fp8 at hidden 72", ValueError, buf.check, "refused")

        def tagged(msg: str) -> None:
            fail(f"hidden 72 after a refused FP8 dispatch: {msg}")

        _run_case(buf, rank, odd, 1, Case("bf16", tokens=(3, 2, 4, 1), hook="both"), tagged)
    except Exception as e:
        fail(raised(e))
    finally:
        buf.destroy()
    return failures


@pytest.mark.parametrize(
    "world, ranks_per_node",
    [
        (2, None),
        pytest.param(2, 1, marks=pytest.mark.slow),
        pytest.param(4, 2, marks=pytest.mark.slow),
    ],
    ids=["W2", "W2-2x1", "W4-2x2"],
)
def test_refused_inputs(launch, world, ranks_per_node):
    """Bad inputs are a ValueError; a refusal on one rank does not hang its peers, whose next
    check() (or call, on CPU ranks) names it; the Buffer stays usable."""
    assert_no_failures(launch(_validation_body, world, ranks_per_node))


# --- expert ids outside [-1, E) ------------------------------------------------------------


class _DropIn:
    """A hybrid_ep_triton.deep_ep.Buffer (low_latency_mode=True) that makes the calls as
    _run_case makes a Buffer's: dispatch returns the library's own handle (which
    _check_dispatch reads) and the event inside DeepEP's, combine takes that handle back, and
    check() is the low-latency Buffer's behind it (DeepEP's API has none)."""

    def __init__(self, world: int, hidden: int, experts: int, tokens: int):
        from hybrid_ep_triton import deep_ep

        budget = deep_ep.Buffer.get_low_latency_rdma_size_hint(tokens, hidden, world, experts)
        self.buffer = deep_ep.Buffer(
            dist.group.WORLD, 0, budget, low_latency_mode=True, explicitly_destroy=True
        )

    def low_latency_dispatch(self, *args, **kwargs):
        recv_x, count, handle, event, hook = self.buffer.low_latency_dispatch(*args, **kwargs)
        return recv_x, count, handle.native, event.event, hook

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, **kwargs):
        out, event, hook = self.buffer.low_latency_combine(
            x, topk_idx, topk_weights, self._deepeps(handle), **kwargs
        )
        return out, event.event, hook

    def get_next_low_latency_combine_buffer(self, handle):
        return self.buffer.get_next_low_latency_combine_buffer(self._deepeps(handle))

    def check(self) -> None:
        self.buffer._low_latency.check()

    def destroy(self) -> None:
        self.buffer.destroy()

    def _deepeps(self, handle):
        from hybrid_ep_triton.deep_ep.sizing import Handle

        return Handle(tuple(handle)[:5], handle, self.buffer._low_latency)


@contextlib.contextmanager
def _refusals_left_to_check():
    """On CPU ranks, whose launches are synchronous, the low-latency calls raise a refusal
    themselves; within this block they leave it to check(), as on GPUs."""
    from hybrid_ep_triton.ops import low_latency as launches

    check_after_launch = launches._check_after_launch
    if rank_device().type == "cpu":
        launches._check_after_launch = lambda rt, received: check_after_launch(rt, False)
    try:
        yield
    finally:
        launches._check_after_launch = check_after_launch


def _with_outside_id(idx: torch.Tensor, outside_id: int, seed: int) -> torch.Tensor:
    """``idx`` with ``outside_id`` at a random entry."""
    idx = idx.clone()
    entry = torch.randint(idx.numel(), (1,), generator=torch.Generator().manual_seed(seed))
    idx.view(-1)[entry] = outside_id
    return idx


def _outside_id_dispatch(buf, rank, grp, index, case, bad, outside_id, hook, fail) -> None:
    """A dispatch in which rank ``bad``'s topk_idx holds ``outside_id``: over the call, its hook
    and check(), exactly one ValueError naming rank ``bad`` on every rank (_peer_refused). No
    rank receives rows from rank ``bad``: every other rank's stats count what the reference
    gives without rank ``bad``'s tokens, and where the outputs are there to read (a hook, or
    GPUs) hold it too (layout_range LL_REFUSED_RANGE for rank ``bad``); rank ``bad``'s stats
    count nothing."""
    dev, world, fmt = rank_device(), grp.world_size, FORMATS[case.fmt]
    inputs = [_inputs(grp, index, case, j, 0)[:2] for j in range(world)]
    x, idx = inputs[rank]
    if rank == bad:
        idx = _with_outside_id(idx, outside_id, index)
    stats = torch.zeros(grp.num_experts // world, dtype=I32, device=dev)
    calls = []

    def run_hook() -> None:
        if calls and calls[0][4] is not None:
            calls[0][4]()

    _peer_refused(
        fail,
        case.name,
        bad,
        [
            lambda: calls.append(
                buf.low_latency_dispatch(
                    x.to(dev),
                    idx.to(dev),
                    grp.tokens,
                    grp.num_experts,
                    cumulative_local_expert_recv_stats=stats,
                    return_recv_hook=hook,
                    **fmt,
                )
            ),
            run_hook,
            buf.check,
        ],
    )
    inputs[bad] = (inputs[bad][0][:0], inputs[bad][1][:0])
    want = reference.low_latency_dispatch(
        [t[0] for t in inputs], [t[1] for t in inputs], grp.num_experts, grp.tokens, rank, **fmt
    )
    counted = torch.zeros_like(want.recv_count) if rank == bad else want.recv_count
    if not torch.equal(stats.cpu(), counted):
        fail(f"{case.name}: stats {stats.tolist()}, expected {counted.tolist()}")
    if calls and rank != bad:
        recv_x, recv_count, handle = calls[0][:3]
        recv_x = tuple(t.cpu() for t in recv_x) if isinstance(recv_x, tuple) else recv_x.cpu()
        want.layout_range[:, bad] = int(LL_REFUSED_RANGE)
        _check_dispatch(
            fail, case.name, (recv_x, recv_count.cpu(), handle), want, case, grp, grp.tokens
        )


def _outside_id_combine(buf, rank, grp, index, case, bad, outside_id, fail) -> None:
    """As on GPUs, where the calls leave a refusal to check(): a dispatch in which rank
    ``bad``'s topk_idx holds ``outside_id``, then a combine along its handle, finish on every
    rank (rank ``bad``'s combine waits for no rows that were never sent to it), and check()
    then raises a ValueError naming rank ``bad`` on every rank, once."""
    dev = rank_device()
    x, idx, w = _inputs(grp, index, case, rank, 0)
    if rank == bad:
        idx = _with_outside_id(idx, outside_id, index)
    with _refusals_left_to_check():
        _, _, handle, _, _ = buf.low_latency_dispatch(
            x.to(dev), idx.to(dev), grp.tokens, grp.num_experts, **FORMATS[case.fmt]
        )
        y = _expert_outputs(grp, index, rank, 0, grp.tokens).to(dev)
        buf.low_latency_combine(y, idx.to(dev), w.to(dev), handle)
    _peer_refused(fail, f"{case.name}, then a combine", bad, [buf.check])


def _outside_ids_body(rank: int, world: int, api: str, ranks_per_node: int | None) -> list[str]:
    failures: list[str] = []

    def fail(msg: str) -> None:
        failures.append(f"rank {rank}: {msg}")

    dev = rank_device()
    E, H, M = V_EXPERTS, V_HIDDEN, V_TOKENS
    grp = Group(world, H, E, M, seed=23, cases=(), ranks_per_node=ranks_per_node)
    if api == "deep_ep":
        buf = _DropIn(world, H, E, M)
    else:
        buf = Buffer(
            None,
            hidden_size=H,
            max_tokens_per_rank=M,
            num_experts=E,
            low_latency_tokens=M,
            ranks_per_node=ranks_per_node,
            device=dev,
            timeout_s=30.0,
        )

    def round_trip(index: int, after: str, **more) -> None:
        def tagged(msg: str) -> None:
            fail(f"round trip after {after}: {msg}")

        case = Case(f"after {after}", tokens=(2, 4), topk=3, stats=True, **more)
        _run_case(buf, rank, grp, index, case, tagged)

    try:
        for index, (outside_id, idx_dtype, fmt, hook) in enumerate(
            (
                (E, I64, "bf16", False),
                (-2, I64, "fp8", True),
                (2**32 + 1, I64, "bf16", True),  # (an int32 of its low bits would be expert 1)
                (E + 3, I32, "ue8m0", False),
            ),
            start=1,
        ):
            bad = index % world
            what = f"expert id {outside_id} ({idx_dtype}) on rank {bad}, {fmt}, hook={hook}"
            case = Case(what, tokens=(3, 4), topk=2, idx_dtype=idx_dtype, fmt=fmt)
            _outside_id_dispatch(buf, rank, grp, index, case, bad, outside_id, hook, fail)
            round_trip(10 + index, what, fmt=fmt, hook="both" if hook else "none")
        for index, outside_id in enumerate((E, -2), start=5):
            bad = index % world
            what = f"expert id {outside_id} on rank {bad}"
            case = Case(what, tokens=(3, 4))
            _outside_id_combine(buf, rank, grp, index, case, bad, outside_id, fail)
            round_trip(10 + index, f"{what}, then a combine", hook="combine")
    except Exception as e:
        fail(raised(e))
    finally:
        buf.destroy()
    return failures


@pytest.mark.parametrize(
    "api, ranks_per_node",
    [("native", None), ("deep_ep", None), pytest.param("native", 1, marks=pytest.mark.slow)],
    ids=["native", "deep_ep", "native-2x1"],
)
def test_expert_ids_outside_the_range_refuse_the_call(launch, api, ranks_per_node):
    """An expert id >= E or < -1 in one rank's topk_idx: the device refuses that rank's
    dispatch (no host synchronisation): every rank raises a ValueError naming it (on CPU ranks
    in the call, on GPUs at check()), no rank receives rows from it, a combine along the
    handle still finishes on every rank, and the Buffer stays usable: the next calls match
    the reference."""
    assert_no_failures(launch(_outside_ids_body, 2, api, ranks_per_node))


# --- topk_idx / topk_weights whose rows are contiguous but not packed -----------------------


def _strided_routing_body(rank: int, world: int) -> list[str]:
    """topk_idx and topk_weights as column slices [:, :K] of [T, E] tensors (stride (E, 1),
    as ``scores.argsort(dim=1)[:, :K]`` gives): rows contiguous, which the input checks
    accept, so they must be read with their row stride."""
    failures: list[str] = []
    grp = Group(world, 128, 4, 4, seed=30, cases=())
    case = Case("strided routing", tokens=(3, 4), topk=2)
    dev = rank_device()
    with Buffer(
        None,
        hidden_size=128,
        max_tokens_per_rank=4,
        num_experts=4,
        low_latency_tokens=4,
        device=dev,
    ) as buf:
        inputs = [_inputs(grp, 0, case, j, 0) for j in range(world)]
        x, idx, w = inputs[rank]
        wide_idx = torch.full((idx.shape[0], 4), -1, dtype=idx.dtype)
        wide_idx[:, :2] = idx
        wide_w = torch.zeros(idx.shape[0], 4)
        wide_w[:, :2] = w
        _, count, handle, _, _ = buf.low_latency_dispatch(
            x.to(dev), wide_idx.to(dev)[:, :2], 4, 4, use_fp8=False
        )
        xs, idxs = [a for a, _, _ in inputs], [b for _, b, _ in inputs]
        want = reference.low_latency_dispatch(xs, idxs, 4, 4, rank)
        if not torch.equal(count.cpu(), want.recv_count):
            failures.append(
                f"rank {rank}: dispatch with strided topk_idx: recv_count "
                f"{count.tolist()}, reference {want.recv_count.tolist()}"
            )
        # Combine with packed topk_idx along a correct handle, strided topk_weights.
        _, _, handle, _, _ = buf.low_latency_dispatch(x.to(dev), idx.to(dev), 4, 4, use_fp8=False)
        ys = [_expert_outputs(grp, 0, j, 0, 4) for j in range(world)]
        out = buf.low_latency_combine(ys[rank].to(dev), idx.to(dev), wide_w.to(dev)[:, :2], handle)[
            0
        ].cpu()
        ref = reference.low_latency_combine(ys, idxs, w, 4, rank)
        abs_ys = [y.float().abs() for y in ys]
        mag = reference.low_latency_combine(abs_ys, idxs, w.abs(), 4, rank)
        _check_combine(
            lambda m: failures.append(f"rank {rank}: strided topk_weights: {m}"),
            "combine",
            out,
            ref,
            mag.float(),
            idx.long(),
        )
    return failures


def test_strided_routing_rows(launch):
    assert_no_failures(launch(_strided_routing_body, 2))


# --- the reference itself ------------------------------------------------------------------


def test_reference_layout_by_hand():
    """reference.low_latency_dispatch / low_latency_combine on a layout worked out by hand: W=2,
    E=4 (rank 0 owns experts 0, 1; rank 1 owns 2, 3)."""
    idxs = [torch.tensor([[0, 2], [1, 0]]), torch.tensor([[0, -1], [3, 1]], dtype=I32)]
    xs = [torch.arange(2 * 4, dtype=BF16).reshape(2, 4) + 10 * j for j in range(2)]
    r0 = reference.low_latency_dispatch(xs, idxs, 4, 3, 0)
    # Expert 0: rank 0's tokens 0, 1 (its own first), then rank 1's token 0; expert 1: rank 0's
    # token 1, then rank 1's token 1.
    assert r0.recv_count.tolist() == [3, 2]
    assert r0.src_info[0, :3].tolist() == [0, 1, 0] and r0.src_info[1, :2].tolist() == [1, 1]
    assert r0.source_rank[0, :3].tolist() == [0, 0, 1]
    assert torch.equal(r0.recv_x[0, :3], torch.stack([xs[0][0], xs[0][1], xs[1][0]]))
    assert r0.layout_range.tolist() == [[2, (2 << 32) | 1], [1, (1 << 32) | 1]]
    assert r0.token_slots.tolist() == [[0, 0], [0, 1]]
    assert tuple(r0.recv_x.shape) == (2, 6, 4)
    r1 = reference.low_latency_dispatch(xs, idxs, 4, 3, 1)
    # Expert 2: rank 0's token 0 (rank 1 has none, so its run is empty at row 0); expert 3:
    # rank 1's own token 1.
    assert r1.recv_count.tolist() == [1, 1]
    assert r1.layout_range.tolist() == [[1, 0], [1 << 32, 1]]
    assert r1.token_slots.tolist() == [[0, -1], [0, 0]]
    # Combine: rank 1's token 1 takes expert 3's row 0 on rank 1 and expert 1's row 1 on rank 0.
    ys = [torch.randn(2, 6, 4).to(BF16) for _ in range(2)]
    w = torch.tensor([[0.5, 9.0], [0.25, 2.0]])
    out = reference.low_latency_combine(ys, idxs, w, 4, 1)
    assert torch.equal(out[0], (0.5 * ys[0][0, 2].float()).to(BF16))
    assert torch.equal(out[1], (0.25 * ys[1][1, 0].float() + 2.0 * ys[0][1, 1].float()).to(BF16))


def test_reference_quantizer():
    """reference.quantize_fp8_low_latency: without round_scale the values of quantize_fp8 (the
    normal mode's, which differs only in its amax floor and in dividing for the scale) where
    amax >= 1e-4; with it power-of-two scales, the least that is at least a / 448; UE8M0 bytes
    their exponents; dequantized within e4m3's rounding."""
    x = _tokens(64, 384, torch.Generator().manual_seed(0))
    amax = x.float().reshape(64, 3, 128).abs().amax(dim=2)
    floor = torch.tensor(1e-4, dtype=torch.float32)
    values, scales = reference.quantize_fp8_low_latency(x)
    normal_values, normal_scales = reference.quantize_fp8(x)
    big = (amax >= floor).repeat_interleave(128, dim=1)
    assert torch.equal(values.view(torch.uint8)[big], normal_values.view(torch.uint8)[big])
    a = torch.maximum(amax, floor)
    assert torch.equal(scales, a * torch.tensor(1 / 448, dtype=torch.float32))
    ratio = scales[amax >= floor] / normal_scales[amax >= floor]
    assert ((ratio - 1).abs() <= 2**-22).all()
    for round_scale in (False, True):
        values, scales = reference.quantize_fp8_low_latency(x, round_scale)
        if round_scale:
            assert ((scales.view(I32) & 0x7FFFFF) == 0).all()  # powers of two
            least = a * torch.tensor(1 / 448, dtype=torch.float32)
            assert (scales >= least).all() and (scales / 2 < least).all()
            words = reference.ue8m0_bytes(scales)
            assert words.dtype == I32 and tuple(words.shape) == (64, 1)
            for g in range(4):
                want = (scales.view(I32)[:, g] >> 23) & 0xFF if g < 3 else torch.zeros(64)
                assert torch.equal((words[:, 0].long() >> (8 * g)) & 0xFF, want.long())
        back = reference.dequantize_fp8(values, scales)
        scale_per_channel = scales.repeat_interleave(128, dim=1)
        assert ((back - x.float()).abs() <= x.float().abs() / 16 + scale_per_channel / 2**10).all()


# --- heap size -------------------------------------------------------------------------------


def test_low_latency_bytes_below_deepeps_hint():
    """Buffer.low_latency_bytes is at most DeepEP's get_low_latency_rdma_size_hint for
    DeepEP-like shapes (hidden a multiple of 128)."""
    over = []
    for hidden in (2048, 4096, 7168):
        for world in (1, 2, 8, 16, 32):
            for experts in (8, 64, 256, 288):
                if experts % world:
                    continue
                for tokens in (1, 128, 256):
                    ours = Buffer.low_latency_bytes(tokens, hidden, world, experts)
                    theirs = deepep_low_latency_bytes(tokens, hidden, world, experts)
                    if not 0 < ours <= theirs:
                        over.append(
                            f"M={tokens} H={hidden} W={world} E={experts}: {ours} > {theirs}"
                        )
    assert not over, "\n".join(over)


# --- fuzz ----------------------------------------------------------------------------------

ON_GPU = DEVICE == "cuda"
FUZZ_TOKENS = 32 if ON_GPU else 4

fuzz_calls = st.fixed_dictionaries(
    {
        "mp": st.integers(1, FUZZ_TOKENS),
        "tokens": st.lists(st.integers(0, FUZZ_TOKENS), min_size=4, max_size=4),
        "topk": st.integers(1, 8),
        "idx_dtype": st.sampled_from([I32, I64]),
        "unused": st.sampled_from([0.0, 0.3, 1.0]),
        "hot": st.one_of(st.none(), st.integers(0, 10**6)),
        "fmt": st.sampled_from(sorted(FORMATS)),
        "hook": st.sampled_from(["none", "dispatch", "combine", "both", "pair"]),
        "layer": st.booleans(),
        "zero_copy": st.booleans(),
        "out": st.booleans(),
        "stats": st.booleans(),
    }
)
fuzz_scenarios = st.fixed_dictionaries(
    {
        "world": st.sampled_from([2, 4]),
        "hidden": st.sampled_from([128, 256]),
        "experts_per_rank": st.integers(1, 3),
        "ranks_per_node": st.sampled_from([None, 1, 2]),
        "calls": st.lists(fuzz_calls, min_size=2, max_size=4),
    }
)


def _fuzz_group(scenario: dict, seed: int) -> Group:
    world = scenario["world"]
    experts = world * scenario["experts_per_rank"]
    cases = []
    for n, call in enumerate(scenario["calls"]):
        mp = call["mp"]
        cases.append(
            Case(
                f"call {n}: {call}",
                tokens=tuple(min(t, mp) for t in call["tokens"]),
                mp=mp,
                topk=min(call["topk"], experts),
                idx_dtype=call["idx_dtype"],
                unused_prob=call["unused"],
                hot_expert=None if call["hot"] is None else call["hot"] % experts,
                fmt=call["fmt"],
                hook=call["hook"],
                layer=call["layer"],
                zero_copy=call["zero_copy"],
                out=call["out"],
                stats=call["stats"],
            )
        )
    per_node = scenario["ranks_per_node"]
    if per_node is not None and world % per_node:
        per_node = None
    return Group(
        world,
        scenario["hidden"],
        experts,
        FUZZ_TOKENS,
        seed=seed,
        cases=tuple(cases),
        ranks_per_node=per_node,
    )


@pytest.mark.slow
@settings(
    max_examples=6,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(scenario=fuzz_scenarios, seed=st.integers(0, 10**6))
def test_random_low_latency_scenarios_match_the_reference(launch, scenario, seed):
    grp = _fuzz_group(scenario, seed)
    assert_no_failures(launch(_rank_body, grp.world_size, grp))


# --- torch.compile ---------------------------------------------------------------------------


def _compile_body(rank: int, world: int, calls: int) -> list[str]:
    """A decode step (dispatch with a hook, hook, experts, combine with a hook, hook) compiled
    with fullgraph=True, against eager calls of the same step and the reference, ``calls``
    times with new tokens and routing (the same shapes)."""
    failures: list[str] = []
    grp = Group(world, 128, 2 * world, 4, seed=40, cases=())
    local, num_experts = 2, 2 * world
    dev = rank_device()
    buf = Buffer(
        None,
        hidden_size=128,
        max_tokens_per_rank=4,
        num_experts=num_experts,
        low_latency_tokens=4,
        device=dev,
    )
    factor = (torch.arange(rank * local, (rank + 1) * local, device=dev) + 1.0)[:, None, None]

    def step(x, idx, w):
        (values, scales), count, handle, _, hook = buf.low_latency_dispatch(
            x, idx, 4, num_experts, use_fp8=True, return_recv_hook=True
        )
        hook()
        rows = values.float().reshape(*values.shape[:2], -1, FP8_GROUP) * scales[..., None]
        y = (rows.reshape(values.shape) * factor).to(BF16)
        out, _, hook = buf.low_latency_combine(y, idx, w, handle, return_recv_hook=True)
        hook()
        return out, count

    backend = "inductor" if dev.type == "cuda" else "aot_eager"
    compiled = torch.compile(step, fullgraph=True, backend=backend, dynamic=False)
    case = Case("compiled", tokens=(4, 3, 2, 4), topk=2, unused_prob=0.2)
    try:
        for call in range(calls):
            inputs = [_inputs(grp, call, case, j, 0) for j in range(world)]
            x, idx, w = (t.to(dev) for t in inputs[rank])
            got, count = compiled(x, idx, w)
            eager, eager_count = step(x, idx, w)
            buf.check()
            what = f"rank {rank}, call {call}"
            if not torch.equal(got, eager) or not torch.equal(count, eager_count):
                failures.append(f"{what}: the compiled step differs from the eager one")
            xs, idxs = [a for a, _, _ in inputs], [b for _, b, _ in inputs]
            want = reference.low_latency_dispatch(xs, idxs, num_experts, 4, rank)
            if not torch.equal(count.cpu(), want.recv_count):
                failures.append(
                    f"{what}: recv_count {count.tolist()}, reference {want.recv_count.tolist()}"
                )
            q = reference.dequantize_fp8(*reference.quantize_fp8_low_latency(inputs[rank][0]))
            ids = inputs[rank][1]
            terms = torch.where(ids >= 0, inputs[rank][2] * (ids + 1), 0.0)
            ref = (terms.sum(dim=1, keepdim=True) * q).to(BF16)
            mag = terms.abs().sum(dim=1, keepdim=True) * q.abs()
            _check_combine(
                lambda m, what=what: failures.append(f"{what}: {m}"),
                "combine",
                got.cpu(),
                ref,
                mag,
                ids,
            )
    except Exception as e:
        failures.append(f"rank {rank}: raised {e!r}"[:2000])
    finally:
        buf.destroy()
    return failures


@pytest.mark.slow
def test_compiled_low_latency_step_matches_eager(launch):
    """torch.compile(fullgraph=True) traces dispatch, hooks and combine without a graph break;
    each compiled call matches eager mode and the reference."""
    assert_no_failures(launch(_compile_body, 2, 3))


@pytest.mark.slow
def test_compiled_low_latency_step_does_not_recompile(launch):
    assert_no_failures(launch(_compile_body, 2, 10))


# --- CUDA graphs (GPU only) ------------------------------------------------------------------


def _graph_body(rank: int, world: int, use_graph: bool) -> list[str]:
    """dispatch (hook) + hook + experts + combine (hook) + hook captured in a CUDA graph
    (``use_graph``; else the same step called again), replayed with new tokens and routing
    copied into the captured inputs: each replay matches the reference, and adds its rows into
    the stats once."""
    return [msg for fmt in ("bf16", "ue8m0") for msg in _graph_replays(rank, world, fmt, use_graph)]


def _graph_replays(rank: int, world: int, fmt: str, use_graph: bool) -> list[str]:
    failures: list[str] = []
    dev = rank_device()
    hidden, tokens, local = (512, 16, 3) if use_graph else (256, 5, 2)
    num_experts = local * world
    grp = Group(world, hidden, num_experts, tokens, seed=50, cases=())
    case = Case(
        f"graph {fmt}", tokens=(tokens,), topk=min(4, num_experts), fmt=fmt, unused_prob=0.2
    )

    def fail(msg: str) -> None:
        failures.append(f"rank {rank} ({fmt}): {msg}")

    buf = Buffer(
        None,
        hidden_size=hidden,
        max_tokens_per_rank=tokens,
        num_experts=num_experts,
        low_latency_tokens=tokens,
        device=dev,
    )
    x, idx, w = (t.to(dev) for t in _inputs(grp, 0, case, rank, 0))
    stats = torch.zeros(local, dtype=I32, device=dev)
    factor = torch.arange(rank * local, (rank + 1) * local, device=dev) + 1.0

    def step():
        recv_x, count, handle, _, hook = buf.low_latency_dispatch(
            x,
            idx,
            tokens,
            num_experts,
            cumulative_local_expert_recv_stats=stats,
            return_recv_hook=True,
            **FORMATS[fmt],
        )
        hook()
        rows = _dequantize(*recv_x, fmt) if fmt != "bf16" else recv_x.float()
        y = (rows * factor[:, None, None]).to(BF16)
        out, _, hook = buf.low_latency_combine(y, idx, w, handle, return_recv_hook=True)
        hook()
        return recv_x, count, handle, out

    try:
        if use_graph:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up: Triton compiles
                step()
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):  # a host synchronisation here would fail the capture
                recv_x, count, handle, out = step()
            torch.cuda.synchronize()
            buf.check()
        for replay in range(1, 4):
            inputs = [_inputs(grp, replay, case, j, 0) for j in range(world)]
            with torch.no_grad():
                for static, new in zip((x, idx, w), inputs[rank], strict=True):
                    static.copy_(new)
            stats.zero_()
            if use_graph:
                graph.replay()
                torch.cuda.synchronize()
            else:
                recv_x, count, handle, out = step()
            buf.check()
            xs, idxs = [a for a, _, _ in inputs], [b for _, b, _ in inputs]
            want = reference.low_latency_dispatch(
                xs, idxs, num_experts, tokens, rank, **FORMATS[fmt]
            )
            got_x = tuple(t.cpu() for t in recv_x) if fmt != "bf16" else recv_x.cpu()
            _check_dispatch(
                lambda m, r=replay: fail(f"replay {r}: {m}"),
                "dispatch",
                (got_x, count.cpu(), handle),
                want,
                case,
                grp,
                tokens,
            )
            if not torch.equal(stats.cpu(), want.recv_count):
                fail(
                    f"replay {replay}: stats {stats.tolist()}, expected {want.recv_count.tolist()}"
                )
            rows = xs[rank].float()
            if fmt != "bf16":
                rows = reference.dequantize_fp8(
                    *reference.quantize_fp8_low_latency(xs[rank], round_scale=True)
                )
            ids = idxs[rank].long()
            terms = torch.where(ids >= 0, inputs[rank][2] * (ids + 1), 0.0)
            ref = (terms.sum(dim=1, keepdim=True) * rows).to(BF16)
            mag = terms.abs().sum(dim=1, keepdim=True) * rows.abs()
            _check_combine(
                lambda m, r=replay: fail(f"replay {r}: {m}"), "combine", out.cpu(), ref, mag, ids
            )
    except Exception as e:
        fail(raised(e))
    finally:
        buf.destroy()
    return failures


@pytest.mark.gpu
@pytest.mark.parametrize("world", [1, 2])
def test_graph_replay_with_hooks_matches_reference(launch, world):
    assert_no_failures(launch(_graph_body, world, True))


def test_calls_on_the_same_input_tensors_match_reference(launch):
    """The graph test's step without a graph (CPU ranks too): the same input tensors refilled
    in place between calls, as a replay sees them."""
    assert_no_failures(launch(_graph_body, 2, False))
