"""The ``hybrid-ep soak`` rank body: many checked dispatch/combine rounds on one Buffer.

Every rank builds one Buffer and runs ``rounds`` rounds on it. Each round draws new inputs: a
token count per rank in 0..tokens (0 and the maximum now and then), a routing with -1 slots and
sometimes one hot expert that every token picks, random rows, weights or none, a pad multiple
and an index dtype (the pad multiple stays 1 with token rows, ``expand=False``), and, where the
hidden size is a multiple of 128, rows in bf16 or a block-scaled format, FP8, MXFP8 or NVFP4
(the pair passed, or bf16 rows with quantize=; checked bit for bit against the reference
quantizer). The dispatch
mode cycles through exact, cached (new rows along the previous
round's handle), max_recv_tokens (sized never to drop a row) and cached again; combine runs
with recv_weights or without weights. Every round is checked against
``hybrid_ep_triton.reference``: dispatch bit for bit, combine within the tolerance of
tests/test_dispatch_combine.py (about two ulps of the dtype, scaled by the summed magnitudes).

Per round it records the time of the library calls (dispatch, check, combine; synchronised on
GPUs) and the memory in use afterwards: ``torch.cuda.memory_allocated()`` and
``max_memory_reserved()`` on GPUs, the process's resident set on CPU ranks. Memory may settle
during a warm-up (10% of the rounds); after it, growth beyond a small bound fails the soak
(a reading over it is taken again after a garbage collection). Time
drift (median of the first vs the last 10% of rounds) is reported, never asserted.

``soak_rank(rank, world_size, config)`` needs only an initialised default process group, like
``demo_rank``.
"""

from __future__ import annotations

import gc
import os
import random
import resource
import statistics
import time
from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import reference
from ..buffer import Buffer
from .demo import generator, human_bytes
from .launcher import rank_device

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# |combine - reference| <= TOL * (1 + sum over the token's slots of |weight * y|): combine sends
# one partial sum per (token, rank) in the Buffer's dtype (as tests/test_dispatch_combine.py).
COMBINE_TOL = {torch.bfloat16: 2e-2, torch.float16: 2e-3, torch.float32: 1e-5}
MODES = ("exact", "cached", "max_recv", "cached")  # round r: MODES[r % 4]
PAD_MULTIPLES = (1, 1, 2, 8)
UNUSED_SLOT_PROBS = (0.0, 0.0, 0.1, 0.5)
HOT_EXPERT_PROB = 0.1
EDGE_TOKENS_PROB = 0.05  # chance of 0 tokens on a rank, and again of the maximum
WEIGHTS_PROB = 0.8  # chance that a round passes topk_weights
# Drawn where hidden % 128 == 0: half bf16, half a block-scaled format's pair or quantize=.
ROW_KINDS = ("bf16",) * 6 + tuple(
    f"{fmt} {how}" for fmt in reference.QUANTIZERS for how in ("pair", "quantize")
)
# Growth of memory in use allowed after the warm-up. GPUs: the retained layout (handle and
# routing, under 2 MiB at 4096 tokens) varies with the token count, a leak of one recv_x per
# round passes the bound within a round or two. CPU ranks: the resident set creeps by a few
# KiB a round under the interpreter (malloc; the Python heap stays flat).
MEMORY_BOUND = {"cuda": 8 << 20, "cpu": 16 << 20}
MAX_MESSAGES = 10  # failure messages kept per rank
# dispatch's outputs checked, by Buffer(expand=...)
NAMES = {
    True: ("recv_x", "recv_weights", "tokens_per_expert"),
    False: ("recv_x", "recv_topk_idx", "recv_topk_weights", "tokens_per_expert"),
}


@dataclass(frozen=True)
class SoakConfig:
    rounds: int
    tokens: int  # most tokens per rank; each round draws 0..tokens
    hidden: int
    experts: int
    topk: int
    dtype: str = "bf16"
    seed: int = 0
    timeout_s: float = 60.0  # the Buffer's timeout_s
    progress_every: int = 0  # rank 0 prints a line every this many rounds; 0: never
    expand: bool = True  # the Buffer's: expert-major rows, or one row per token
    ranks_per_node: int | None = None  # the Buffer's: nodes of that many ranks (None: hosts)


@dataclass
class _Layout:
    """One round's routing, kept for the cached rounds that follow it."""

    num_tokens: int
    topk_idx: torch.Tensor
    pad_multiple: int
    max_recv_tokens: int | None
    hot_expert: int | None
    handle: object = None  # the Buffer's DispatchHandle


def soak_rank(rank: int, world_size: int, cfg: SoakConfig) -> dict:
    """Run the soak on this rank; returns its summary (see ``format_summary``)."""
    device = rank_device()
    on_gpu = device.type == "cuda"
    buf = Buffer(
        None,
        device=device,
        hidden_size=cfg.hidden,
        max_tokens_per_rank=cfg.tokens,
        num_experts=cfg.experts,
        dtype=DTYPES[cfg.dtype],
        timeout_s=cfg.timeout_s,
        expand=cfg.expand,
        ranks_per_node=cfg.ranks_per_node,
    )
    messages: list[str] = []
    failed_rounds = 0
    memory, peak, seconds = [], [], []
    warmup, bound = _warmup_rounds(cfg), MEMORY_BOUND["cuda" if on_gpu else "cpu"]
    collected = 0  # readings over the bound that a garbage collection brought under it
    seen: Counter = Counter()  # rounds with each feature (see _round)
    layout = None
    started = time.monotonic()
    try:
        for r in range(cfg.rounds):
            try:
                layout, elapsed, problems = _round(buf, device, cfg, world_size, r, layout, seen)
            except Exception as e:  # ranks may be out of step now: stop here
                failed_rounds += 1
                messages.append(f"round {r}: raised {e!r}; stopped")
                break
            if problems:
                failed_rounds += 1
                messages.extend(f"round {r}: {p}" for p in problems)
            seconds.append(elapsed)
            in_use, most = _memory(on_gpu)
            if r == warmup:
                limit = max(memory) + bound  # the growth check's (see _summary)
            if r >= warmup and in_use > limit:
                # Read again after a garbage collection: memory that it frees was held by
                # objects in reference cycles awaiting Python's collector, not leaked (on GPUs,
                # spikes of one round's rows that are back to the steady figure at the next
                # reading).
                gc.collect()
                in_use, most = _memory(on_gpu)
                collected += in_use <= limit
            memory.append(in_use)
            peak.append(most)
            if rank == 0 and cfg.progress_every and (r + 1) % cfg.progress_every == 0:
                # A round whose call takes a new kernel specialisation compiles it first.
                builds = (
                    f", {buf.kernel_builds} kernel builds so far "
                    f"({buf.kernel_build_seconds:.1f} s in them)"
                    if on_gpu
                    else ""
                )
                print(
                    f"soak: round {r + 1}/{cfg.rounds} at {time.monotonic() - started:.0f} s, "
                    f"{failed_rounds} failing, memory "
                    f"{human_bytes(in_use)}, median dispatch+combine "
                    f"{statistics.median(seconds[-cfg.progress_every :]) * 1e3:.2f} ms{builds}",
                    flush=True,
                )
    finally:
        buf.destroy()
    summary = _summary(rank, cfg, on_gpu, failed_rounds, messages, memory, peak, seconds, collected)
    summary["coverage"] = dict(seen)
    return summary


def _round(buf: Buffer, dev, cfg: SoakConfig, world: int, r: int, prev, seen: Counter):
    """One checked round; returns (the layout later cached rounds use, library seconds,
    problems found). Counts the round's features in ``seen``."""
    shared = random.Random(f"soak/{cfg.seed}/{r}")  # the same draws on every rank
    mine = random.Random(f"soak/{cfg.seed}/{r}/{dist.get_rank()}")
    gen = generator(dev, mine.getrandbits(62))
    mode = MODES[r % len(MODES)] if prev is not None else "exact"
    kind = shared.choice(ROW_KINDS) if cfg.hidden % reference.FP8_GROUP == 0 else "bf16"
    with_weights = shared.random() < WEIGHTS_PROB
    weighted_combine = shared.random() < 0.5 and with_weights  # combine with recv_weights
    if mode == "cached":
        layout = prev
    else:
        layout = _new_layout(cfg, world, mode, shared, mine, gen, dev)
    idx = layout.topk_idx
    x = torch.randn(layout.num_tokens, cfg.hidden, generator=gen, device=dev, dtype=buf.dtype)
    w = torch.rand(idx.shape, generator=gen, device=dev) if with_weights else None
    seen.update(
        name
        for name, present in {
            mode: True,
            "no tokens": layout.num_tokens == 0,
            "-1 slots": bool((idx < 0).any()),
            "hot expert": layout.hot_expert is not None,
            "pad_multiple > 1": layout.pad_multiple > 1,
            "int32 ids": idx.dtype == torch.int32,
            "topk_weights": with_weights,
            "weighted combine": weighted_combine,
            "unweighted combine": not weighted_combine,
            kind: kind != "bf16",
        }.items()
        if present
    )

    # The library, timed: dispatch and check, then combine of random expert outputs.
    fmt, _, how = kind.partition(" ")
    rows = reference.QUANTIZERS[fmt](x) if how == "pair" else x
    quantize = fmt if how == "quantize" else False
    _sync(dev)
    start = time.perf_counter()
    if mode == "cached":
        *got, handle = buf.dispatch(rows, topk_weights=w, handle=layout.handle, quantize=quantize)
    else:
        *got, handle = buf.dispatch(
            rows,
            idx,
            w,
            pad_multiple=layout.pad_multiple,
            max_recv_tokens=layout.max_recv_tokens,
            quantize=quantize,
        )
        layout.handle = handle
    buf.check(handle)  # sized never to overflow: raises nothing
    seconds = time.perf_counter() - start
    got_scales = None
    if kind != "bf16":  # compared as bytes and scales
        (values, got_scales), *rest = got
        got = [values.view(torch.uint8), *rest]
        got_scales = _bytes(got_scales)
    y = torch.randn(got[0].shape[0], cfg.hidden, generator=gen, device=dev, dtype=buf.dtype)
    _sync(dev)
    start = time.perf_counter()
    out = buf.combine(y, handle, weights=_row_weights(got, cfg.expand, weighted_combine))
    _sync(dev)
    seconds += time.perf_counter() - start

    # The reference (block-scaled rows: the reference quantizer, then the values and scales as
    # bytes dispatched alike), and the checks.
    kw = dict(
        num_experts=cfg.experts,
        pad_multiple=layout.pad_multiple,
        max_recv_tokens=layout.max_recv_tokens,
        expand=cfg.expand,
    )
    ref_rows = x
    problems = []
    what = f"{mode} dispatch of {layout.num_tokens} tokens ({kind})"
    if kind != "bf16":
        values, scales = reference.QUANTIZERS[fmt](x)
        ref_rows = values.view(torch.uint8)
        if not _same(got_scales, reference.dispatch(None, _bytes(scales), idx, w, **kw)[0]):
            problems.append(f"{what}: the {fmt} scales differ from the reference")
    *want, ref_handle = reference.dispatch(None, ref_rows, idx, w, **kw)
    problems += [
        f"{what}: {name} differs from the reference"
        for name, a, b in zip(NAMES[cfg.expand], got, want, strict=True)
        if not _same(a, b)
    ]
    ref_w = _row_weights(want, cfg.expand, weighted_combine)
    problem = _combine_problem(out, y, ref_handle, ref_w)
    if problem:
        problems.append(f"combine after the {what} (weights: {weighted_combine}): {problem}")
    return layout, seconds, problems


def _bytes(scales: torch.Tensor) -> torch.Tensor:
    """One-byte scales (E8M0, e4m3) as uint8, which the reference dispatches; float32 as is."""
    return scales.view(torch.uint8) if scales.element_size() == 1 else scales


def _row_weights(outputs: list, expand: bool, weighted: bool):
    """combine's per-row weights when ``weighted``: recv_weights, or with token rows each row's
    slot weights summed."""
    if not weighted:
        return None
    return outputs[1] if expand else outputs[2].sum(dim=1)


def _combine_problem(out: torch.Tensor, y: torch.Tensor, ref_handle, ref_weights) -> str | None:
    """How ``out`` is off the reference combine of ``y``, or None: |out - reference| must be
    at most COMBINE_TOL * (1 + the reference combine of |y| with |weights|)."""
    want = reference.combine(None, y, ref_handle, weights=ref_weights)
    if out.shape != want.shape or out.dtype != want.dtype:
        return f"got {tuple(out.shape)} {out.dtype}, reference {tuple(want.shape)} {want.dtype}"
    abs_w = None if ref_weights is None else ref_weights.abs()
    magnitude = reference.combine(None, y.float().abs(), ref_handle, weights=abs_w)
    ratio = (out.float() - want.float()).abs() / (COMBINE_TOL[y.dtype] * (1 + magnitude))
    if ratio.numel() and ratio.max().item() > 1:
        bad = int((ratio > 1).any(dim=1).sum())
        return f"{bad} tokens off the reference, by up to {ratio.max().item():.3g} x the tolerance"
    return None


def _new_layout(cfg: SoakConfig, world: int, mode: str, shared, mine, gen, dev) -> _Layout:
    """Token count and routing of a round that computes a new layout."""
    pad = shared.choice(PAD_MULTIPLES) if cfg.expand else 1
    unused = shared.choice(UNUSED_SLOT_PROBS)
    hot = shared.randrange(cfg.experts) if shared.random() < HOT_EXPERT_PROB else None
    idx_dtype = shared.choice((torch.int32, torch.int64))
    draw = mine.random()
    if draw < EDGE_TOKENS_PROB:
        num_tokens = 0
    elif draw < 2 * EDGE_TOKENS_PROB:
        num_tokens = cfg.tokens
    else:
        num_tokens = mine.randint(0, cfg.tokens)
    scores = torch.rand(num_tokens, cfg.experts, generator=gen, device=dev)
    if hot is not None:
        scores[:, hot] = 2.0  # above every other score: in every token's top-k
    idx = scores.topk(cfg.topk, dim=1).indices  # distinct ids per row
    shuffle = torch.rand(idx.shape, generator=gen, device=dev).argsort(dim=1)
    idx = idx.gather(1, shuffle)  # the hot expert in any slot
    idx[torch.rand(idx.shape, generator=gen, device=dev) < unused] = -1
    local = cfg.experts // world
    # Buffer.dispatch's bound for never dropping a row.
    max_recv = world * cfg.tokens
    if cfg.expand:
        max_recv = world * cfg.tokens * min(cfg.topk, local) + local * (pad - 1)
    max_recv = max_recv if mode == "max_recv" else None
    return _Layout(num_tokens, idx.to(idx_dtype), pad, max_recv, hot)


def _same(got: torch.Tensor | None, want: torch.Tensor | None) -> bool:
    if got is None or want is None:
        return got is want
    return got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _memory(on_gpu: bool) -> tuple[int, int]:
    """(bytes in use, peak bytes): CUDA allocated and max reserved, or the resident set and its
    high-water mark (which the kernel updates lazily)."""
    if on_gpu:
        # The reference's collectives through gloo record their CUDA tensors on gloo's streams,
        # and the caching allocator frees such blocks only at its next allocation, once their
        # events are done: after a synchronize, one allocation frees them (the growth check's
        # spikes of objects in reference cycles need a garbage collection too, see soak_rank).
        torch.cuda.synchronize()
        torch.empty(1, device="cuda")
        return torch.cuda.memory_allocated(), torch.cuda.max_memory_reserved()
    with open("/proc/self/statm") as f:
        resident = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return resident, max(resident, peak_kib * 1024)


def _warmup_rounds(cfg: SoakConfig) -> int:
    """The rounds (10%) during which memory may settle."""
    return max(1, cfg.rounds // 10)


def _summary(
    rank, cfg, on_gpu, failed_rounds, messages, memory, peak, seconds, collected=0
) -> dict:
    done = len(seconds)
    tenth = max(1, done // 10)
    warmup = _warmup_rounds(cfg)
    bound = MEMORY_BOUND["cuda" if on_gpu else "cpu"]
    growth = max(memory[warmup:]) - max(memory[:warmup]) if done > warmup else 0
    if growth > bound:
        messages.append(
            f"memory in use grew by {human_bytes(growth)} after the {warmup}-round warm-up "
            f"(bound {human_bytes(bound)})"
        )
    if done < cfg.rounds and failed_rounds == 0:
        messages.append(f"only {done} of {cfg.rounds} rounds ran")
    median = statistics.median
    return {
        "rank": rank,
        "rounds": done,
        "failures": failed_rounds,
        "messages": messages[:MAX_MESSAGES],
        "memory_kind": "allocated" if on_gpu else "resident",
        "peak_kind": "max reserved" if on_gpu else "peak resident",
        "memory_first": memory[0] if memory else 0,
        "memory_last": memory[-1] if memory else 0,
        "memory_growth": growth,
        "memory_bound": bound,
        "memory_collected": collected,
        "peak_first": peak[0] if peak else 0,
        "peak_last": peak[-1] if peak else 0,
        "ms_first": median(seconds[:tenth]) * 1e3 if seconds else float("nan"),
        "ms_last": median(seconds[-tenth:]) * 1e3 if seconds else float("nan"),
        "ok": failed_rounds == 0 and done == cfg.rounds and growth <= bound,
    }


def format_summary(s: dict) -> str:
    """One line: rounds, failures, memory first/last, and the median library time of a round
    (dispatch, check, combine) in the first and the last 10% of the rounds."""
    drift = (s["ms_last"] / s["ms_first"] - 1) * 100 if s["ms_first"] > 0 else float("nan")
    n = s["memory_collected"]
    collected = f", {n} readings over it were under it after a garbage collection" if n else ""
    return (
        f"soak rank {s['rank']}: {s['rounds']} rounds, {s['failures']} failures; "
        f"memory {s['memory_kind']} first {human_bytes(s['memory_first'])}, last "
        f"{human_bytes(s['memory_last'])}, growth after warm-up "
        f"{human_bytes(max(s['memory_growth'], 0))} (bound {human_bytes(s['memory_bound'])}"
        f"{collected}); {s['peak_kind']} first {human_bytes(s['peak_first'])}, last "
        f"{human_bytes(s['peak_last'])}; median dispatch+combine {s['ms_first']:.2f} ms in the "
        f"first 10%, {s['ms_last']:.2f} ms in the last 10% (drift {drift:+.1f}%); "
        + ("OK" if s["ok"] else "FAILED")
    )
