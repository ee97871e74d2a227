"""Device time of every kernel of a dispatch and a combine, per launch shape (S1 by default).

Where the time of a call goes: the layout kernels and the data moves, whose launches hold
``num_sms`` senders and ``local_programs`` programs for the work that stays on the GPU.
Each variant is ``SMS:LOCAL_PROGRAMS``; an exact-mode dispatch, a cached dispatch and a combine
are run ``--iters`` times after a warm-up under torch.profiler, and every rank prints the mean
time per launch of each kernel in µs (bench/host_profile.py splits the host side of each call).
Run on a machine with the GPUs:

    python3 bench/stages.py --variants 8:132,8:264,32:132
"""

import argparse
import statistics
from collections import defaultdict

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
        buf.destroy()
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--variants", default="8:132")
    parser.add_argument("--shape", default="S1", choices=sorted(SHAPES))
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    world = torch.cuda.device_count()
    for lines in run_ranks(_rank, world, args, device="cuda", timeout_s=500):
        print("\n".join(lines))


if __name__ == "__main__":
    main()
