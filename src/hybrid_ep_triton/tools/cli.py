"""Command line: ``hybrid-ep <command>`` (or ``python -m hybrid_ep_triton <command>``).

Each command is a function taking the parsed arguments and returning an exit code, registered
in ``COMMANDS`` with a function that adds its options to its subparser. The options of every
command are defined here, and parsing them imports neither torch nor any module that does (the
commands import what they need when they run): ``hybrid-ep <command> --help`` answers at once.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import NamedTuple

from .. import __version__
from ..runtime.cache_location import cache_path


class Command(NamedTuple):
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    epilog: Callable[[], str] | None = None  # text after the options in --help, made then


def help_with_default(action: argparse.Action) -> str:
    """An option's help as --help shows it: with its default, unless the help already says it
    (defaults chosen per device when the command runs) or the option is a flag."""
    if action.nargs == 0 or action.default is None or "default" in action.help:
        return action.help
    return f"{action.help} (default: %(default)s)"


class _HelpFormatter(argparse.HelpFormatter):
    def _get_help_string(self, action: argparse.Action) -> str:
        return help_with_default(action)


def _per_device_arguments(
    p: argparse.ArgumentParser, helps: dict[str, str], defaults: dict, kind: Callable = int
) -> None:
    """An option per entry of ``helps`` (name: help), whose default the command takes when it
    runs from ``defaults["cpu"]`` or ``defaults["cuda"]``, by the device it runs on."""
    for name, what in helps.items():
        cpu, gpu = (_shown(defaults[device][name]) for device in ("cpu", "cuda"))
        p.add_argument(
            f"--{name.replace('_', '-')}",
            type=kind,
            help=f"{what} (default: {cpu} on CPU ranks; {gpu} on GPUs)",
        )


def _shown(value) -> str:
    """A default as it is written on the command line (lists comma-separated)."""
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)


def _per_device_values(args: argparse.Namespace, defaults: dict) -> dict:
    """``defaults`` (one device's), each replaced by its option where the command line gave it."""
    return {k: v if getattr(args, k) is None else getattr(args, k) for k, v in defaults.items()}


# -- demo, soak and tune: one process per rank on this machine ---------------------------

SIZE_OPTIONS = {
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


class CommandError(Exception):
    """A bad command line, or ranks that failed: ``main`` prints it and returns 2."""


def _rank_arguments(
    p: argparse.ArgumentParser, sizes: dict, cpu_ranks: int, timeout: float, tokens_help: str
) -> None:
    """--ranks, --device, the size options (defaults per device from ``sizes``),
    --ranks-per-node, --seed and --timeout (seconds for the whole run)."""
    p.add_argument(
        "--ranks", type=int, help=f"ranks (default: every local GPU, or {cpu_ranks} CPU ranks)"
    )
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="cuda: one process per GPU (NCCL), or several sharing each GPU under CUDA MPS "
        "(gloo) when --ranks is above the GPU count; cpu: gloo and the Triton interpreter; "
        "auto: cuda when torch sees a GPU",
    )
    _per_device_arguments(p, {**SIZE_OPTIONS, "tokens": tokens_help}, sizes)
    p.add_argument(
        "--ranks-per-node",
        type=int,
        help="nodes of this many consecutive ranks, the others reached over the network "
        "(default: the ranks of a host; on CPU ranks, nodes are simulated)",
    )
    p.add_argument(
        "--allow-time-slicing",
        action="store_true",
        help="let ranks share GPUs without the CUDA MPS daemon (every wait between them then "
        "takes milliseconds); by default --ranks above the GPU count needs MPS running",
    )
    p.add_argument("--seed", type=int, default=0, help="random seed of the inputs")
    p.add_argument(
        "--timeout", type=float, default=timeout, help="seconds before giving up on the whole run"
    )


def _nodes(args: argparse.Namespace) -> str:
    """What --ranks-per-node said, for the line that says what runs."""
    return f", nodes of {args.ranks_per_node} ranks" if args.ranks_per_node else ""


def _rank_plan(args: argparse.Namespace, sizes: dict, cpu_ranks: int) -> tuple[str, int, dict]:
    """(device, ranks, sizes) from the options of ``_rank_arguments``; CommandError if invalid."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = args.device if args.device != "auto" else ("cuda" if gpus else "cpu")
    if device == "cuda" and not gpus:
        raise CommandError("--device cuda, but torch sees no CUDA device")
    ranks = args.ranks if args.ranks is not None else (gpus if device == "cuda" else cpu_ranks)
    if ranks < 1:
        raise CommandError(f"--ranks must be at least 1, got {ranks}")
    chosen = _per_device_values(args, sizes[device])
    if chosen["experts"] % ranks:
        raise CommandError(
            f"--experts ({chosen['experts']}) must be a multiple of --ranks ({ranks})"
        )
    per_node = args.ranks_per_node
    if per_node is not None and (per_node < 1 or ranks % per_node):
        raise CommandError(f"--ranks-per-node must divide --ranks ({ranks}), got {per_node}")
    if not 1 <= chosen["topk"] <= chosen["experts"] or chosen["tokens"] < 0 or chosen["hidden"] < 1:
        raise CommandError(f"need tokens >= 0, hidden >= 1 and 1 <= topk <= experts, got {chosen}")
    return device, ranks, chosen


def _on_ranks(command: str, details: str, fn, cfg, device, ranks, args) -> tuple[list, float]:
    """Print what runs where, run ``fn(rank, ranks, cfg)`` on the ranks; returns (per-rank
    results, seconds). CommandError if a rank fails or ranks cannot share the GPUs."""
    from .launcher import GpuSharingUnavailable, RankFailure, ranks_per_gpu, run_ranks

    kind = "CPU ranks (gloo, Triton interpreter)"
    if device == "cuda":
        per_gpu = ranks_per_gpu(ranks)
        kind = "GPU ranks (NCCL)" if per_gpu == 1 else f"GPU ranks, up to {per_gpu} per GPU (gloo)"
    print(f"hybrid-ep {command}: {ranks} {kind}; {details}", flush=True)
    start = time.perf_counter()
    try:
        results = run_ranks(
            fn,
            ranks,
            cfg,
            device=device,
            timeout_s=args.timeout,
            allow_time_slicing=args.allow_time_slicing,
        )
    except (RankFailure, GpuSharingUnavailable) as e:
        raise CommandError(str(e)) from None
    return results, time.perf_counter() - start


def _demo_arguments(p: argparse.ArgumentParser) -> None:
    _rank_arguments(p, DEMO_SIZES, CPU_RANKS, 600.0, SIZE_OPTIONS["tokens"])


def run_demo(args: argparse.Namespace) -> int:
    """One MoE layer on every rank, checked against the reference; exit code 1 on mismatch."""
    from .demo import DemoConfig, demo_rank

    device, ranks, sizes = _rank_plan(args, DEMO_SIZES, CPU_RANKS)
    cfg = DemoConfig(**sizes, seed=args.seed, ranks_per_node=args.ranks_per_node)
    details = (
        f"{cfg.tokens} tokens per rank, hidden {cfg.hidden}, {cfg.experts} experts, "
        f"top-{cfg.topk}, bf16{_nodes(args)}"
    )
    ok, seconds = _on_ranks("demo", details, demo_rank, cfg, device, ranks, args)
    print(f"{'OK' if all(ok) else 'MISMATCH'} in {seconds:.1f} s", flush=True)
    return 0 if all(ok) else 1


# Tiny under the CPU interpreter; the demo's DeepSeek-V3-like sizes on GPUs.
SOAK_SIZES = {
    "cpu": {"tokens": 8, "hidden": 16, "experts": 8, "topk": 2},
    "cuda": DEMO_SIZES["cuda"],
}
SOAK_ROUNDS = {"cpu": {"rounds": 20}, "cuda": {"rounds": 10_000}}
SOAK_CPU_RANKS = 2
SOAK_DTYPES = ("bf16", "fp16", "fp32")  # soak.DTYPES: their torch dtypes


def _soak_arguments(p: argparse.ArgumentParser) -> None:
    _rank_arguments(
        p, SOAK_SIZES, SOAK_CPU_RANKS, 3600.0, "most tokens per rank (each round draws 0..this)"
    )
    _per_device_arguments(p, {"rounds": "rounds"}, SOAK_ROUNDS)
    p.add_argument("--dtype", choices=SOAK_DTYPES, default="bf16", help="token element type")
    p.add_argument(
        "--op-timeout",
        type=float,
        default=60.0,
        help="the Buffer's timeout_s: seconds a wait on another rank may last",
    )
    p.add_argument(
        "--progress-every",
        type=int,
        help="rank 0 prints a line every this many rounds (default: rounds / 20; 0: never)",
    )
    p.add_argument(
        "--token-rows",
        action="store_true",
        help="a Buffer with one row per token (expand=False) instead of expert-major rows",
    )


def run_soak(args: argparse.Namespace) -> int:
    """Many dispatch/combine rounds on one Buffer with changing token counts, routing and modes,
    every round checked against the reference; memory growth after a warm-up fails, time drift
    is reported. One summary line per rank; exit code 1 on any failure."""
    from .soak import SoakConfig, format_summary, soak_rank

    device, ranks, sizes = _rank_plan(args, SOAK_SIZES, SOAK_CPU_RANKS)
    rounds = _per_device_values(args, SOAK_ROUNDS[device])["rounds"]
    if rounds < 1 or args.op_timeout <= 0:
        raise CommandError(
            f"need --rounds >= 1 and --op-timeout > 0, got {rounds}, {args.op_timeout}"
        )
    every = args.progress_every if args.progress_every is not None else max(1, rounds // 20)
    cfg = SoakConfig(
        rounds=rounds,
        **sizes,
        dtype=args.dtype,
        seed=args.seed,
        timeout_s=args.op_timeout,
        progress_every=max(every, 0),
        expand=not args.token_rows,
        ranks_per_node=args.ranks_per_node,
    )
    details = (
        f"{rounds} rounds of 0..{cfg.tokens} tokens per rank, hidden {cfg.hidden}, "
        f"{cfg.experts} experts, top-{cfg.topk}, {cfg.dtype}"
        f"{', token rows' if args.token_rows else ''}{_nodes(args)}"
    )
    summaries, seconds = _on_ranks("soak", details, soak_rank, cfg, device, ranks, args)
    for s in summaries:
        print(format_summary(s))
        covered = ", ".join(f"{name} {n}" for name, n in sorted(s["coverage"].items()))
        print(f"  rank {s['rank']} rounds with: {covered}")
        for message in s["messages"]:
            print(f"  rank {s['rank']}: {message}")
    ok = all(s["ok"] for s in summaries)
    print(f"{'OK' if ok else 'FAILED'} in {seconds:.1f} s", flush=True)
    return 0 if ok else 1


def _bench_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=int, help="ranks, one per GPU (default: every local GPU)")
    p.add_argument("--sms", default="4,8,16,24,32", help="SM budgets (num_sms) for S1 and S2")
    p.add_argument("--spot-sms", default="8,24", help="SM budgets for the hidden-size spot checks")
    p.add_argument(
        "--shapes",
        default="S1,S2,H2880,H4096",
        help="shapes, of S1 (4096 tokens per rank, hidden 7168, top-8 of 256 experts), S2 (128 "
        "tokens, same model), H2880 and H4096 (S1 at hidden 2880, 4096: spot checks)",
    )
    p.add_argument(
        "--ranks-per-node",
        type=int,
        help="also run S1 and S2 with the GPUs split into nodes of this many, at the spot SMs "
        "(default: one node only)",
    )
    p.add_argument(
        "--formats",
        default="fp8,mxfp8,nvfp4",
        help="block-scaled row formats whose dispatch is timed beside bf16 on S1 and S2 (empty: "
        "bf16 only; the quantizing copies are timed for every format)",
    )
    p.add_argument("--warmup", type=int, default=10, help="untimed calls before each measurement")
    p.add_argument("--iters", type=int, default=50, help="timed calls (the median counts)")
    p.add_argument("--out", default="bench/results", help="folder of the .json, .md and .png")
    p.add_argument("--timeout", type=float, default=1800, help="seconds for the whole run")


def run_bench(args: argparse.Namespace) -> int:
    """Benchmark dispatch and combine on the local GPUs against the ceiling and NCCL."""
    from .bench import run

    return run(args)


# The demo's sizes; the CPU ranks' grid is a few candidates of a small shape, to try the tool
# (the interpreter's times say nothing about a GPU's).
TUNE_SIZES = DEMO_SIZES
TUNE_CPU_RANKS = 2
TUNE_GRID_OPTIONS = {
    "chunks": "tokens per chunk",
    "block_h": "dispatch tile widths (combine uses half)",
    "warps": "warps per program",
    "slices": "column slices per chunk",
    "unroll": "expert rows combine gathers at once",
    "stages": "tile loads in flight in the streaming copies",
}
# The interpreter takes 2 gathers and 1 stage whatever is asked (planner.make_config).
TUNE_GRID = {
    "cpu": {
        "chunks": [8, 16],
        "block_h": [32, 64],
        "warps": [4],
        "slices": [1, 2],
        "unroll": [2],
        "stages": [1],
    },
    "cuda": {
        "chunks": [16, 32],
        "block_h": [256, 512, 1024],
        "warps": [4, 8, 16],
        "slices": [1, 2, 4],
        "unroll": [4, 8],
        "stages": [4],
    },
}
TUNE_RUNS = {
    "cpu": {"sms": 2, "warmup": 1, "iters": 3},
    "cuda": {"sms": 8, "warmup": 5, "iters": 20},
}
TUNE_DTYPES = ("bfloat16", "float16", "float32")  # Buffer's SUPPORTED_DTYPES, by torch's names


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def _tune_arguments(p: argparse.ArgumentParser) -> None:
    _rank_arguments(p, TUNE_SIZES, TUNE_CPU_RANKS, 3600.0, SIZE_OPTIONS["tokens"])
    p.add_argument("--dtype", choices=TUNE_DTYPES, default="bfloat16", help="token element type")
    p.add_argument(
        "--rows",
        choices=("expert", "token"),
        default="expert",
        help="output layout: expert-major rows, or token rows (Buffer(expand=False))",
    )
    helps = {
        "sms": "SM budget of the senders (num_sms)",
        "warmup": "untimed calls per candidate",
        "iters": "timed calls per candidate (the median counts)",
    }
    _per_device_arguments(p, helps, TUNE_RUNS)
    grid_helps = {k: f"{v}, comma-separated" for k, v in TUNE_GRID_OPTIONS.items()}
    _per_device_arguments(p, grid_helps, TUNE_GRID, kind=_ints)


def _tune_epilog() -> str:
    return (
        f"The fastest candidate is stored in {cache_path()} (the folder: $HEP_CACHE_DIR, else "
        "$XDG_CACHE_HOME/hybrid_ep_triton, else ~/.cache/hybrid_ep_triton), under a key of the "
        "GPU, Triton version, ranks, hidden size, dtype, rows and nodes; a Buffer built with "
        "the same reads it."
    )


def run_tune(args: argparse.Namespace) -> int:
    """Sweep the kernels' parameters for one shape and cache the fastest for this machine: every
    combination of the grid's values is a candidate, timed on its own Buffer (a cached-handle
    dispatch plus a combine, the slowest rank's median)."""
    from .tune import run

    device, ranks, sizes = _rank_plan(args, TUNE_SIZES, TUNE_CPU_RANKS)
    if device == "cuda":
        from .launcher import ranks_per_gpu

        if ranks_per_gpu(ranks) > 1:
            raise CommandError(
                f"tune times one rank per GPU: {ranks} ranks would share the GPUs, and times "
                "under MPS are not speeds"
            )
    chosen = {**sizes, **_per_device_values(args, {**TUNE_RUNS[device], **TUNE_GRID[device]})}
    return run(argparse.Namespace(**{**vars(args), **chosen, "device": device, "ranks": ranks}))


def _prebuild_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "records",
        nargs="+",
        help="files of records (.jsonl, or .jsonl.xz compressed), or directories of them, as "
        "a run with HEP_RECORD_BUILDS=DIR writes them into DIR",
    )
    p.add_argument(
        "--workers", type=int, default=os.cpu_count(), help="processes compiling side by side"
    )
    p.add_argument(
        "--arch",
        type=_compute_capability,
        help="compile for this GPU architecture without it, e.g. on a CPU machine whose cache "
        "then goes to the GPU machines: 90 or sm_90 (H100, H200), 100 (B200) (default: this "
        "machine's GPU)",
    )
    p.add_argument(
        "--merge-into",
        metavar="FILE",
        help="write the distinct records into FILE (.jsonl, or .jsonl.xz compressed) instead "
        "of building them, e.g. to gather the records of every rank and step in one file "
        "(default: build them)",
    )


def _compute_capability(text: str) -> int:
    return int(text.removeprefix("sm_"))


def _prebuild_epilog() -> str:
    return (
        "Builds go into Triton's cache ($TRITON_CACHE_DIR, else ~/.triton/cache), which the "
        "next run on this machine reads. A record that the kernels no longer take (their "
        "parameters changed since) is listed and skipped. With --arch, the GPU machine finds "
        "a build only if it runs the same Triton wheel on the same Python version, with "
        "NVSHMEM's device bitcode of the same content."
    )


def run_prebuild(args: argparse.Namespace) -> int:
    """Compile the kernel specialisations that earlier runs recorded (HEP_RECORD_BUILDS=DIR),
    side by side, so that the next run loads each from Triton's cache at its first launch
    instead of compiling it there."""
    from .prebuild import prebuild, read_records, triton_key_digest, write_records

    missing = [path for path in args.records if not os.path.exists(path)]
    if missing:
        raise CommandError(f"no such file or directory: {' '.join(missing)}")
    records = read_records(args.records)
    if not records:
        raise CommandError(f"no records in {' '.join(args.records)}")
    if args.merge_into:
        write_records(records, args.merge_into)
        print(f"{len(records)} records in {args.merge_into}")
        return 0
    try:
        built, stale, seconds, refused = prebuild(records, args.workers, args.arch)
    except ValueError as error:
        raise CommandError(str(error)) from None
    print(
        f"{built} kernel builds ready in {seconds:.1f} s (from {len(records)} records; "
        f"triton_key {triton_key_digest()})"
    )
    for why in stale:
        print(f"  skipped {why}")
    for why in refused:
        print(f"  refused {why}")
    return 0


COMMANDS: dict[str, Command] = {
    "demo": Command("run one checked MoE dispatch/combine round", _demo_arguments, run_demo),
    "bench": Command(
        "benchmark on the local GPUs (writes bench/results/)", _bench_arguments, run_bench
    ),
    "tune": Command(
        "tune kernel parameters, cache the best", _tune_arguments, run_tune, _tune_epilog
    ),
    "soak": Command(
        "many checked dispatch/combine rounds: failures, memory growth, drift",
        _soak_arguments,
        run_soak,
    ),
    "prebuild": Command(
        "compile recorded kernel builds ahead of a run, in parallel",
        _prebuild_arguments,
        run_prebuild,
        _prebuild_epilog,
    ),
}


def _fail(message: str) -> int:
    print(f"hybrid-ep: error: {message}", file=sys.stderr, flush=True)
    return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hybrid-ep",
        description="Expert-parallel MoE dispatch/combine in Triton. "
        "`hybrid-ep COMMAND --help` lists a command's options.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, cmd in COMMANDS.items():
        p = sub.add_parser(
            name,
            help=cmd.help,
            description=cmd.run.__doc__,
            epilog=cmd.epilog() if cmd.epilog else None,
            formatter_class=_HelpFormatter,
        )
        cmd.add_arguments(p)
        p.set_defaults(run=cmd.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return args.run(args)
    except CommandError as e:
        return _fail(str(e))
