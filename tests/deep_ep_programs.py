"""Run DeepEP's own test programs (tests/legacy/test_intranode.py, test_low_latency.py) against
``hybrid_ep_triton.deep_ep``, on ranks that share the local GPUs (GPU only: their code is CUDA's).

    python tests/deep_ep_programs.py DEEPEP_DIR [--program intranode|low_latency] [--ranks 2]
        [--num-tokens 128] [--hidden 7168] [--num-topk 8] [--num-experts 64] [--shrink-test]
        [--peer-timeout-s 60]

DEEPEP_DIR is a copy of DeepEP's files that this runner reads and never fetches (the GPU
machines reach no network): tests/legacy/test_intranode.py, tests/legacy/test_low_latency.py,
deep_ep/utils/math.py and deep_ep/utils/testing.py, e.g. from a git mirror of DeepEP:

    git -C DEEPEP_MIRROR archive HEAD tests/legacy deep_ep/utils/math.py \\
        deep_ep/utils/testing.py | tar -x -C build/deepep    # build/ is ignored: carry it

Each rank (hybrid_ep_triton.tools.launcher: gloo when ranks share a GPU, under CUDA MPS) makes
``import deep_ep`` give this package (``register()``), loads DeepEP's two helper modules from
DEEPEP_DIR as ``deep_ep.utils.math`` and ``deep_ep.utils.testing`` (plain torch and numpy), gives
``deep_ep.utils.envs`` an ``init_dist`` that hands over the launcher's group, sets the default
dtype and device as DeepEP's init_dist does, and calls the program's ``test_main`` with a
``deep_ep.Buffer`` made as its ``test_loop`` makes one. Each rank prints the program's output and
reports "passed" or the traceback of the first failing check. DeepEP's ``bench_kineto`` times
kernels by DeepEP's kernel names, which no kernel here has: it is replaced by a stop, reported
as "passed (every check ...)" when reached (docs/deep_ep.md).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import traceback
import types
from pathlib import Path


class TimingsReached(Exception):
    """DeepEP's program reached bench_kineto, which times kernels by DeepEP's kernel names (no
    kernel here has them): every check before it passed."""


def _timings_reached(*args, **kwargs):
    raise TimingsReached


def _load(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _prepare(deepep_dir: Path, rank: int, world: int, group):
    """deep_ep is this package, with DeepEP's helpers and an init_dist of the launcher's group."""
    import torch
    import torch.distributed as dist

    import hybrid_ep_triton.deep_ep as deep_ep

    deep_ep.register()
    utils = sys.modules["deep_ep.utils"]
    for helper in ("math", "testing"):
        module = _load(f"deep_ep.utils.{helper}", deepep_dir / "deep_ep" / "utils" / f"{helper}.py")
        setattr(utils, helper, module)
    utils.testing.bench_kineto = _timings_reached
    envs = types.ModuleType("deep_ep.utils.envs")
    envs.init_dist = lambda local_rank, num_local_ranks, seed=0: (rank, world, group)
    sys.modules["deep_ep.utils.envs"] = utils.envs = envs
    sys.path.insert(0, str(deepep_dir / "tests" / "legacy"))
    # The programs gather into [W, ...] outputs, which NCCL takes and gloo (ranks sharing a GPU)
    # takes only as [W * N, ...]: the same memory.
    gather_into_tensor = dist.all_gather_into_tensor

    def all_gather_into_tensor(output, input, group=None, async_op=False):
        flat = output.view(-1, *input.shape[1:])
        return gather_into_tensor(flat, input, group=group, async_op=async_op)

    dist.all_gather_into_tensor = all_gather_into_tensor
    # What DeepEP's init_dist sets before its programs run.
    torch.set_default_dtype(torch.bfloat16)
    torch.set_default_device("cuda")
    return deep_ep


def _rank(rank: int, world: int, deepep_dir: str, program: str, sizes: dict) -> str:
    import torch.distributed as dist

    group = dist.group.WORLD
    deep_ep = _prepare(Path(deepep_dir), rank, world, group)
    tokens, hidden = sizes["num_tokens"], sizes["hidden"]
    topk, experts = sizes["num_topk"], sizes["num_experts"]
    try:
        if program == "intranode":
            import test_intranode

            buffer = deep_ep.Buffer(
                group,
                int(2e9),
                0,
                low_latency_mode=False,
                num_qps_per_rank=1,
                explicitly_destroy=True,
                timeout_s=sizes["peer_timeout_s"],
            )
            args = argparse.Namespace(**sizes)
            test_intranode.test_main(args, 24, rank, world, rank, buffer, group)
        else:
            import test_low_latency

            rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(tokens, hidden, world, experts)
            buffer = deep_ep.Buffer(
                group,
                num_rdma_bytes=rdma,
                low_latency_mode=True,
                num_qps_per_rank=experts // world,
                explicitly_destroy=True,
                enable_shrink=sizes["shrink_test"],
                timeout_s=sizes["peer_timeout_s"],
            )
            test_low_latency.test_main(
                tokens,
                hidden,
                experts,
                topk,
                rank,
                world,
                group,
                buffer,
                shrink_test=sizes["shrink_test"],
                seed=1,
            )
    except TimingsReached:
        buffer.destroy()
        return f"rank {rank}: passed (every check; DeepEP's kernel timings not run)"
    except Exception:
        return f"rank {rank}: FAILED\n{traceback.format_exc()}"
    buffer.destroy()
    return f"rank {rank}: passed"


def main() -> int:
    from hybrid_ep_triton.tools.launcher import run_ranks

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("deepep_dir", type=Path, help="a copy of DeepEP's files (see above)")
    parser.add_argument("--program", choices=("intranode", "low_latency"), default="intranode")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--num-tokens", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--num-topk", type=int, default=8)
    parser.add_argument("--num-experts", type=int, default=64)
    parser.add_argument("--timeout-s", type=float, default=1200, help="for the whole run")
    parser.add_argument(
        "--peer-timeout-s",
        type=float,
        default=60.0,
        help="deep_ep.Buffer's timeout_s: with --shrink-test, what each of the "
        "three failures costs the others",
    )
    parser.add_argument(
        "--shrink-test",
        action="store_true",
        help="low_latency: DeepEP's rank failures (ranks 1, 3, 5 stop calling; "
        "8 ranks or more), with enable_shrink",
    )
    args = parser.parse_args()
    name = {"intranode": "test_intranode.py", "low_latency": "test_low_latency.py"}
    needed = [args.deepep_dir / "tests" / "legacy" / name[args.program]]
    needed += [args.deepep_dir / "deep_ep" / "utils" / f"{m}.py" for m in ("math", "testing")]
    missing = [str(p) for p in needed if not p.is_file()]
    if missing:
        parser.error(f"not in {args.deepep_dir}: {', '.join(missing)} (see --help)")
    sizes = dict(
        num_tokens=args.num_tokens,
        hidden=args.hidden,
        num_topk=args.num_topk,
        num_experts=args.num_experts,
        allow_mnnvl=False,
        shrink_test=args.shrink_test,
        peer_timeout_s=args.peer_timeout_s,
    )
    # By its module's name (not __main__), so that the rank processes can import it.
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from deep_ep_programs import _rank

    results = run_ranks(
        _rank,
        args.ranks,
        str(args.deepep_dir.resolve()),
        args.program,
        sizes,
        device="cuda",
        timeout_s=args.timeout_s,
    )
    print("\n".join(results))
    return 0 if all(": passed" in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
