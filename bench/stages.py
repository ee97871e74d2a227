"""Device time of every kernel of a dispatch and a combine, per launch shape (S1 by default).

Where the time of a call goes: the layout kernels and the data moves, whose launches hold
``num_sms`` senders and ``local_programs`` programs for the work that stays on the GPU.
Each variant is ``SMS:LOCAL_PROGRAMS``; an exact-mode dispatch, a cached dispatch and a combine
are run ``--iters`` times after a warm-up under torch.profiler, and every rank prints the mean
time per launch of each kernel in µs. With ``--host``, rank 0 also profiles the host side of
each eager call (cProfile, the functions with the most own time). Run on a machine with the GPUs:

    python3 bench/stages.py --variants 8:132,8:264,32:132 [--host]
"""

import argparse
import cProfile
import io
import pstats
import statistics
import time
from collections import defaultdict
from functools import partial

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import hybrid_ep_triton as hep
from hybrid_ep_triton.tools.bench import SHAPES, _inputs
from hybrid_ep_triton.tools.launcher import run_ranks


def _kernel_times(prof) -> dict[str, float]:
    per_name = defaultdict(list)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            per_name[event.name.split("(")[0]].append(event.device_time_total)
    return {name: statistics.mean(times) for name, times in per_name.items()}


def _host_profile(calls: dict, iters: int) -> list[str]:
    """Host µs per eager call, issued one at a time (synchronised) and back to back as the
    benchmark does (events around each call), then where the back-to-back calls' host time goes
    (cProfile: own time, then cumulative)."""
    lines = []
    for name, call in calls.items():
        alone, back_to_back = [], []
        for _ in range(iters):
            torch.cuda.synchronize()
            dist.barrier()
            t0 = time.perf_counter()
            call()
            alone.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
        profiler = cProfile.Profile()
        for _ in range(iters):
            t0 = time.perf_counter()
            profiler.enable()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            profiler.disable()
            back_to_back.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
        lines.append(
            f"## host, {name}: median {statistics.median(alone):.0f} µs per call alone, "
            f"{statistics.median(back_to_back):.0f} back to back (profiled)"
        )
        for order, count in (("tottime", 12), ("cumulative", 30)):
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(count)
            lines += [line for line in text.getvalue().splitlines() if line.strip()][3:]
    return lines


def _rank(rank: int, world: int, args) -> list[str]:
    shape = SHAPES[args.shape]
    x, topk_idx, weights = _inputs(shape, rank, seed=0)
    lines = []
    for variant in args.variants.split(","):
        sms, local_programs = (int(v) for v in variant.split(":"))
        buf = hep.Buffer(None, hidden_size=shape.hidden, max_tokens_per_rank=shape.tokens,
                         num_experts=shape.experts, num_sms=sms)  # fmt: skip
        buf._rt.local_programs = local_programs
        recv_x, recv_w, _, handle = buf.dispatch(x, topk_idx, weights)
        for _ in range(args.warmup):
            buf.dispatch(x, handle=handle)
            buf.combine(recv_x, handle, weights=recv_w)
        torch.cuda.synchronize()
        dist.barrier()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.iters):
                buf.dispatch(x, topk_idx, weights)
                buf.dispatch(x, handle=handle)
                buf.combine(recv_x, handle, weights=recv_w)
            torch.cuda.synchronize()
        times = _kernel_times(prof)
        row = " ".join(f"{name} {us:.0f}" for name, us in sorted(times.items()))
        lines.append(f"rank {rank} {args.shape} sms {sms} local {local_programs}: {row}")
        if args.host:
            max_rows = handle.num_recv_rows * 11 // 10  # as the benchmark's, 10% headroom
            host = _host_profile(
                {
                    "exact dispatch": partial(buf.dispatch, x, topk_idx, weights),
                    "max_recv dispatch": partial(
                        buf.dispatch, x, topk_idx, weights, max_recv_tokens=max_rows
                    ),
                    "cached dispatch": partial(buf.dispatch, x, handle=handle),
                    "combine": partial(buf.combine, recv_x, handle, weights=recv_w),
                },
                args.iters,
            )
            if rank == 0:
                lines += host
        buf.destroy()
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--variants", default="8:132")
    parser.add_argument("--shape", default="S1", choices=sorted(SHAPES))
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--host", action="store_true", help="profile the host side too")
    args = parser.parse_args()
    world = torch.cuda.device_count()
    for lines in run_ranks(_rank, world, args, device="cuda", timeout_s=500):
        print("\n".join(lines))


if __name__ == "__main__":
    main()
