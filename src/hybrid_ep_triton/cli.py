"""Command line: ``hybrid-ep <command>`` (or ``python -m hybrid_ep_triton <command>``).

Each command is a function taking the parsed arguments and returning an exit code, registered
in ``COMMANDS`` with a function that adds its options to its subparser.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import NamedTuple

import torch

from . import __version__


class Command(NamedTuple):
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


# -- demo -----------------------------------------------------------------------------------

DEMO_OPTIONS = {
    "tokens": "tokens per rank",
    "hidden": "hidden size",
    "experts": "global experts",
    "topk": "experts per token",
}
# Small under the CPU interpreter; DeepSeek-V3-like on GPUs.
DEMO_SIZES = {
    "cpu": {"tokens": 16, "hidden": 64, "experts": 16, "topk": 4},
    "cuda": {"tokens": 4096, "hidden": 7168, "experts": 256, "topk": 8},
}
CPU_RANKS = 4


def _demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--ranks", type=int, help=f"ranks (default: every local GPU, or {CPU_RANKS} CPU ranks)"
    )
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="cuda: NCCL, one process per GPU; cpu: gloo and the Triton interpreter "
        "(default: cuda when a GPU is visible)",
    )
    for name, what in DEMO_OPTIONS.items():
        cpu, gpu = DEMO_SIZES["cpu"][name], DEMO_SIZES["cuda"][name]
        p.add_argument(f"--{name}", type=int, help=f"{what} (default: {cpu} on CPU, {gpu} on GPU)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    p.add_argument(
        "--timeout", type=float, default=600.0, help="seconds before giving up (default: 600)"
    )


def run_demo(args: argparse.Namespace) -> int:
    """One MoE layer on every rank, checked against the reference; exit code 1 on mismatch."""
    from ._demo import DemoConfig, demo_rank
    from ._launcher import RankFailure, run_ranks

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = args.device if args.device != "auto" else ("cuda" if gpus else "cpu")
    if device == "cuda" and not gpus:
        return _fail("--device cuda, but torch sees no CUDA device")
    ranks = args.ranks if args.ranks is not None else (gpus if device == "cuda" else CPU_RANKS)
    if ranks < 1 or device == "cuda" and ranks > gpus:
        return _fail(f"--ranks must be in [1, {gpus if device == 'cuda' else 'any'}], got {ranks}")
    sizes = {k: getattr(args, k) for k in DEMO_OPTIONS if getattr(args, k) is not None}
    cfg = DemoConfig(**{**DEMO_SIZES[device], **sizes}, seed=args.seed)
    if cfg.experts % ranks:
        return _fail(f"--experts ({cfg.experts}) must be a multiple of --ranks ({ranks})")
    if not 1 <= cfg.topk <= cfg.experts or cfg.tokens < 0 or cfg.hidden < 1:
        return _fail(f"need tokens >= 0, hidden >= 1 and 1 <= topk <= experts, got {cfg}")

    where = "GPU ranks (NCCL)" if device == "cuda" else "CPU ranks (gloo, Triton interpreter)"
    print(
        f"hybrid-ep demo: {ranks} {where}; {cfg.tokens} tokens per rank, hidden {cfg.hidden}, "
        f"{cfg.experts} experts, top-{cfg.topk}, bf16",
        flush=True,
    )
    start = time.perf_counter()
    try:
        ok = run_ranks(demo_rank, ranks, cfg, device=device, timeout_s=args.timeout)
    except RankFailure as e:
        return _fail(str(e))
    print(f"{'OK' if all(ok) else 'MISMATCH'} in {time.perf_counter() - start:.1f} s", flush=True)
    return 0 if all(ok) else 1


def _bench_arguments(p: argparse.ArgumentParser) -> None:
    from ._bench import add_arguments

    add_arguments(p)


def run_bench(args: argparse.Namespace) -> int:
    """Benchmark dispatch and combine on the local GPUs against the ceiling and NCCL."""
    from ._bench import run

    return run(args)


def _tune_arguments(p: argparse.ArgumentParser) -> None:
    from ._tune import add_arguments

    add_arguments(p)


def run_tune(args: argparse.Namespace) -> int:
    """Sweep the kernels' parameters for one shape and cache the fastest for this machine."""
    from ._tune import run

    return run(args)


COMMANDS: dict[str, Command] = {
    "demo": Command("run one checked MoE dispatch/combine round", _demo_arguments, run_demo),
    "bench": Command(
        "benchmark on the local GPUs (writes bench/results/)", _bench_arguments, run_bench
    ),
    "tune": Command("tune kernel parameters, cache the best", _tune_arguments, run_tune),
}


def _fail(message: str) -> int:
    print(f"hybrid-ep: error: {message}", file=sys.stderr, flush=True)
    return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hybrid-ep", description="Expert-parallel MoE dispatch/combine in Triton."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, cmd in COMMANDS.items():
        p = sub.add_parser(name, help=cmd.help, description=cmd.run.__doc__)
        cmd.add_arguments(p)
        p.set_defaults(run=cmd.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return args.run(args)
