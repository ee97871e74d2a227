"""``hybrid-ep tune``: sweep the kernels' free parameters for one shape and cache the fastest.

Candidates are every combination of tokens per chunk, dispatch tile width (combine uses half),
warps per program, column slices per chunk, expert rows combine gathers at once and tile loads
in flight in the streaming copies, at the given SM budget (``num_sms``: the senders get that
many SMs' worth of warps), for one dtype and output layout (``--rows``: expert-major rows, the
default, or token rows, ``Buffer(expand=False)``), each cached under its own key.
Each candidate gets its own Buffer; the score is the time of a cached-handle dispatch (the data
move) plus a combine, medians of ``iters`` calls after ``warmup``, the slowest rank's. The
timing is the benchmark's (CUDA events) rather than ``triton.testing.do_bench``: do_bench picks
its repetition count from each process's own first measurements, and these calls are
collective, so every rank must make exactly the same number of them.
"""

import argparse
import itertools

import torch

from ..buffer import SUPPORTED_DTYPES, Buffer
from ..runtime.cache_location import cache_path
from ..runtime.planner import KernelConfig, make_config
from ..runtime.tuning import cache_key, forced, store
from .bench import median_us
from .launcher import run_ranks

_DTYPES = {str(dtype).removeprefix("torch."): dtype for dtype in SUPPORTED_DTYPES}


def _candidates(args: argparse.Namespace, on_gpu: bool) -> list[KernelConfig]:
    grid = itertools.product(
        args.chunks, args.block_h, args.warps, args.slices, args.unroll, args.stages
    )
    return [
        make_config(args.sms, chunk, block_h, slices, warps, on_gpu, unroll, stages)
        for chunk, block_h, warps, slices, unroll, stages in grid
    ]


def _tune_rank(rank: int, world: int, opts: dict) -> tuple[str, list[tuple[float, float]]]:
    device = torch.device("cuda", torch.cuda.current_device()) if opts["on_gpu"] else None
    device = device or torch.device("cpu")
    dtype, expand = _DTYPES[opts["dtype"]], opts["rows"] == "expert"
    g = torch.Generator().manual_seed(opts["seed"] * 1000 + rank)
    x = torch.randn(opts["tokens"], opts["hidden"], generator=g, device="cpu").to(dtype).to(device)
    scores = torch.rand(opts["tokens"], opts["experts"], generator=g, device="cpu")
    idx = scores.topk(opts["topk"], dim=1).indices.to(device)
    weights = torch.rand(idx.shape, generator=g, device="cpu").to(device)
    progress = _progress(len(opts["candidates"])) if rank == 0 else None
    times = []
    for config in opts["candidates"]:
        with forced(config):
            buf = Buffer(
                None,
                hidden_size=opts["hidden"],
                max_tokens_per_rank=opts["tokens"],
                num_experts=opts["experts"],
                dtype=dtype,
                expand=expand,
                ranks_per_node=opts["ranks_per_node"],
            )
        times.append(_score(buf, x, idx, weights, opts["warmup"], opts["iters"]))
        buf.destroy()
        if progress:
            progress()
    return cache_key(device, world, opts["hidden"], dtype, expand, buf.ranks_per_node), times


def _score(buf, x, idx, weights, warmup: int, iters: int) -> tuple[float, float]:
    """(cached-handle dispatch µs, combine µs) of one Buffer."""
    outputs = buf.dispatch(x, idx, weights)
    recv_x, handle = outputs[0], outputs[-1]
    # Expert-major rows are summed with their routing weights; with token rows, y is already
    # the weighted sum of a token's local experts.
    recv_w = outputs[1] if buf.expand else None
    y = torch.randn_like(recv_x)
    t_dispatch, _ = median_us(
        lambda: buf.dispatch(x, None, weights, handle=handle), [()], warmup, iters
    )
    t_combine, _ = median_us(lambda: buf.combine(y, handle, weights=recv_w), [()], warmup, iters)
    return t_dispatch, t_combine


def _progress(total: int):
    """A callable that advances a progress bar (rich if installed, else a counter line)."""
    try:
        from rich.progress import Progress
    except ImportError:
        done = [0]

        def step():
            done[0] += 1
            print(f"tune: {done[0]}/{total} candidates", flush=True)

        return step
    bar = Progress(transient=False)
    task = bar.add_task("tuning", total=total)
    bar.start()

    def step():
        bar.advance(task)
        if bar.finished:
            bar.stop()

    return step


def run(args: argparse.Namespace) -> int:
    """Tune on ``args.ranks`` ranks of ``args.device`` ("cpu" or "cuda"), every option given
    (``hybrid-ep tune`` fills in the defaults of the device)."""
    on_gpu = args.device == "cuda"
    candidates = _candidates(args, on_gpu)
    opts = dict(on_gpu=on_gpu, candidates=candidates)
    problem = ("tokens", "hidden", "experts", "topk", "dtype", "rows", "ranks_per_node", "seed")
    opts.update({k: getattr(args, k) for k in problem})
    opts.update(warmup=args.warmup, iters=args.iters)
    per_rank = run_ranks(_tune_rank, args.ranks, opts, device=args.device, timeout_s=args.timeout)
    key = per_rank[0][0]
    # Per candidate, the slowest rank's: (dispatch + combine, dispatch, combine) µs.
    scores = [
        max((d + c, d, c) for d, c in (r[1][i] for r in per_rank)) for i in range(len(candidates))
    ]
    best = min(range(len(candidates)), key=scores.__getitem__)
    _, dispatch_us, combine_us = scores[best]
    for config, (total, d, c) in sorted(zip(candidates, scores, strict=True), key=lambda p: p[1]):
        print(f"{total:10.1f} µs (dispatch {d:.1f}, combine {c:.1f})  {config}")
    measured = dict(
        dispatch_us=dispatch_us,
        combine_us=combine_us,
        tokens=args.tokens,
        experts=args.experts,
        topk=args.topk,
    )
    store(key, candidates[best], measured)
    print(f"best for {key}: {candidates[best]}\nstored in {cache_path()}")
    return 0
