"""Eager calls back to back on the local GPUs, for A/B runs of two source trees in one device
call:

    PYTHONPATH=<tree>/src python3 bench/eager_ab.py --label A [--iters 200] [--ranks N]

One rank per GPU (default: one rank; ``--ranks 0``: every local GPU); for S1 and S2 (8 SMs) in
both layouts, the median of ``iters`` back-to-back calls of an exact-mode dispatch, a cached
dispatch and a combine (events around each call on the calling stream, after a warm-up; the
slowest rank's median, see tools.bench.median_us), device and host µs, one line each; before
and after them the host's speed (host_profile.host_speed).
"""

import argparse

import torch
from host_profile import eager_calls, host_speed  # bench/, beside this script

import hybrid_ep_triton as hep
from hybrid_ep_triton.tools.bench import SHAPES, inputs, median_us
from hybrid_ep_triton.tools.launcher import run_ranks


def _rank(rank: int, world: int, args) -> list[str]:
    lines = [f"{args.label} before: {host_speed()}"]
    for name in ("S1", "S2"):
        shape = SHAPES[name]
        sets = [inputs(shape, rank, seed) for seed in range(4)]
        for expand in (True, False):
            buf = hep.Buffer(None, hidden_size=shape.hidden, max_tokens_per_rank=shape.tokens,
                             num_experts=shape.experts, num_sms=8, expand=expand)  # fmt: skip
            calls = eager_calls(buf, sets)
            for what in ("exact dispatch", "cached dispatch", "combine"):
                fn, args_list = calls[what]
                device_us, host_us = median_us(fn, args_list, args.warmup, args.iters)
                rows = "expert" if expand else "token"
                lines.append(f"{args.label} {name} {rows} {what}: {device_us:.1f} us device, "
                             f"{host_us:.1f} us host")  # fmt: skip
            buf.destroy()
    lines.append(f"{args.label} after: {host_speed()}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--label", default="")
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--ranks", type=int, default=1, help="0: every local GPU")
    args = parser.parse_args()
    world = args.ranks or torch.cuda.device_count()
    print("\n".join(run_ranks(_rank, world, args, device="cuda", timeout_s=300)[0]), flush=True)


if __name__ == "__main__":
    main()
