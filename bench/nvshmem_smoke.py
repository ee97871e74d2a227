#!/usr/bin/env python3
"""Smoke test of the NVSHMEM symmetric heap (``hybrid_ep_triton.runtime.nvshmem``) on one node.

    python bench/nvshmem_smoke.py [--world 2] [--mib 64] [--timeout 300]

Spawns ``--world`` ranks (torch.multiprocessing, spawn) with an NCCL group, one GPU each.
Every rank allocates one symmetric block of ``--mib`` MiB, then:

1. store: a Triton kernel casts the peer's int64 base address to a float32 pointer and
   writes a pattern into the next rank's block; after barrier each rank checks every
   element it received;
2. load: a Triton kernel reads the previous rank's block through its peer address into a
   private tensor, checked likewise;
3. close() (twice: idempotent), finalize, destroy the process group.

Each rank prints ``[rank r] PASS`` or ``[rank r] FAIL ...`` (with a traceback on an
exception); the parent prints versions, a summary, and exits 0 only if every rank passed.
A hung run is killed after ``--timeout`` seconds, after dumping every rank's Python stacks.
"""

from __future__ import annotations

import os

# Before torch/NCCL/NVSHMEM read them (children inherit the environment). No multicast
# objects on the target machine.
for _k, _v in {
    "NVSHMEM_DISABLE_NVLS": "1",
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
}.items():
    os.environ.setdefault(_k, _v)

import argparse  # noqa: E402
import faulthandler  # noqa: E402
import importlib.util  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

MODULE_PATH = (
    Path(__file__).resolve().parents[1] / "src" / "hybrid_ep_triton" / "runtime" / "nvshmem.py"
)
# Element i written by rank r is (i & PATTERN_MASK) + (r + 1) * TAG_UNIT: never 0 (the
# zero fill), distinct per writer, exact in float32 (< 2**24) for up to 15 ranks.
PATTERN_MASK = 0xFFFFF
TAG_UNIT = float(1 << 20)
BLOCK = 1024


@triton.jit
def _store_to_peer(peer_bases_ptr, peer, n_elem, tag, MASK: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elem
    base = tl.load(peer_bases_ptr + peer)  # int64 byte address of the peer's block
    dst = base.to(tl.pointer_type(tl.float32))
    vals = (offs & MASK).to(tl.float32) + tag
    tl.store(dst + offs, vals, mask=mask)


@triton.jit
def _load_from_peer(peer_bases_ptr, peer, out_ptr, n_elem, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elem
    base = tl.load(peer_bases_ptr + peer)
    src = base.to(tl.pointer_type(tl.float32))
    tl.store(out_ptr + offs, tl.load(src + offs, mask=mask), mask=mask)


def _load_nvshmem_module():
    # Load the file itself: a half-edited package __init__ must not break this smoke test.
    name = "hybrid_ep_triton_nvshmem_smoke"
    spec = importlib.util.spec_from_file_location(name, MODULE_PATH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _expected(n_elem: int, writer: int, device: torch.device) -> torch.Tensor:
    idx = torch.arange(n_elem, device=device, dtype=torch.int64)
    return (idx & PATTERN_MASK).to(torch.float32) + (writer + 1) * TAG_UNIT


def _compare(what: str, got: torch.Tensor, want: torch.Tensor) -> str | None:
    bad = (got != want).nonzero()
    if bad.numel() == 0:
        return None
    i = int(bad[0, 0])
    return (
        f"{what}: {bad.shape[0]} of {got.numel()} elements wrong; first at {i}: "
        f"got {got[i].item()!r}, want {want[i].item()!r}"
    )


def _versions() -> str:
    out = [f"python {sys.version.split()[0]}", f"torch {torch.__version__}"]
    out.append(f"cuda(torch) {torch.version.cuda}")
    out.append(f"triton {triton.__version__}")
    try:
        import nvshmem
        import nvshmem.core

        out.append(f"nvshmem4py {nvshmem.__version__}")
        out.append(f"libnvshmem {nvshmem.core.get_version().libnvshmem_version}")
    except Exception as exc:
        out.append(f"nvshmem ? ({exc!r})")
    try:
        import cuda.core

        out.append(f"cuda.core {getattr(cuda.core, '__version__', '?')}")
    except Exception as exc:
        out.append(f"cuda.core ? ({exc!r})")
    out.append(f"gpu {torch.cuda.get_device_name()}")
    return ", ".join(out)


def _run(rank: int, world: int, port: int, nbytes: int) -> bool:
    t0 = time.monotonic()

    def log(msg: str) -> None:
        print(f"[rank {rank}] {time.monotonic() - t0:7.2f}s {msg}", flush=True)

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        device_id=device,
    )
    group = dist.group.WORLD
    log("process group up")

    nv = _load_nvshmem_module()
    nv.ensure_initialized(group, device, heap_bytes=nbytes)
    log(
        f"NVSHMEM initialised (NVSHMEM_SYMMETRIC_SIZE={os.environ.get('NVSHMEM_SYMMETRIC_SIZE')}"
        f", NVSHMEM_DISABLE_NVLS={os.environ.get('NVSHMEM_DISABLE_NVLS')})"
    )
    if rank == 0:
        log("versions: " + _versions())

    alloc = nv.NvshmemAllocation(group, nbytes, device, ranks_per_node=world)
    log(f"allocated {alloc!r}, peer_bases={[hex(int(b)) for b in alloc.peer_bases.tolist()]}")

    errors: list[str] = []
    local, bases = alloc.local, alloc.peer_bases
    if local.dtype != torch.uint8 or local.shape != (nbytes,) or local.device != device:
        errors.append(f"local is {local.dtype} {tuple(local.shape)} on {local.device}")
    if int(torch.count_nonzero(local)) != 0:
        errors.append("local not zero-filled")
    if bases.dtype != torch.int64 or bases.shape != (world,) or bases.device != device:
        errors.append(f"peer_bases is {bases.dtype} {tuple(bases.shape)} on {bases.device}")
    base_list = bases.tolist()
    if base_list[rank] != local.data_ptr():
        errors.append(f"peer_bases[{rank}]={base_list[rank]:#x} != {local.data_ptr():#x}")
    if 0 in base_list or len(set(base_list)) != world:
        errors.append(f"peer_bases not distinct non-zero: {[hex(b) for b in base_list]}")
    # Informational: kernels that vectorise region accesses want >= 16 B alignment.
    low_bits = [b & -b for b in base_list if b]
    align = min(low_bits + [1 << 21]) if low_bits else 0
    log(f"block alignment: {align} B (capped at 2 MiB)")

    n_elem = nbytes // 4
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    grid = (triton.cdiv(n_elem, BLOCK),)

    # 1. store into the next rank's block.
    _store_to_peer[grid](bases, nxt, n_elem, (rank + 1) * TAG_UNIT, MASK=PATTERN_MASK, BLOCK=BLOCK)
    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda.synchronize()
    got = local.view(torch.float32)
    err = _compare(f"store from rank {prv}", got, _expected(n_elem, prv, device))
    if err:
        errors.append(err)
    log(f"store check: {'ok' if err is None else 'WRONG'}")

    # 2. load the previous rank's block (written by the rank before it in step 1).
    out = torch.empty(n_elem, dtype=torch.float32, device=device)
    _load_from_peer[grid](bases, prv, out, n_elem, BLOCK=BLOCK)
    torch.cuda.synchronize()
    err = _compare(f"load from rank {prv}", out, _expected(n_elem, (prv - 1) % world, device))
    if err:
        errors.append(err)
    log(f"load check: {'ok' if err is None else 'WRONG'}")
    del got, out, local, bases

    # A second block: its own addresses; left open so that finalize() has to free it.
    extra = nv.NvshmemAllocation(group, 4096, device, ranks_per_node=world)
    extra_bases = extra.peer_bases.tolist()
    if extra_bases[rank] != extra.local.data_ptr() or set(extra_bases) & set(base_list):
        errors.append(f"second block peer_bases {[hex(b) for b in extra_bases]}")

    dist.barrier()
    alloc.close()
    alloc.close()  # idempotent
    if alloc.local is not None or alloc.peer_bases is not None:
        errors.append("close() left local/peer_bases set")
    nv.finalize()  # also frees `extra`
    nv.finalize()  # idempotent
    log("closed and finalised")
    dist.destroy_process_group()

    for e in errors:
        log(f"FAIL: {e}")
    print(f"[rank {rank}] {'PASS' if not errors else 'FAIL'}", flush=True)
    return not errors


def _worker(rank: int, world: int, port: int, nbytes: int, timeout_s: float) -> None:
    # A hung rank shows where it hangs: stacks on timeout and when the parent kills it.
    faulthandler.enable(all_threads=True)
    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
    faulthandler.dump_traceback_later(max(10.0, timeout_s - 20.0), exit=False)
    try:
        ok = _run(rank, world, port, nbytes)
    except BaseException:
        print(f"[rank {rank}] FAIL (exception)\n{traceback.format_exc()}", flush=True)
        sys.stderr.flush()
        # Skip atexit: NVSHMEM finalize there would wait for ranks that are not coming.
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if ok else 1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--mib", type=int, default=64, help="symmetric block size per rank, MiB")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds before killing")
    args = ap.parse_args()

    if importlib.util.find_spec("nvshmem") is None:
        print("FAIL: nvshmem4py not installed (pip install --no-deps .whl/nvshmem4py_cu13-*.whl)")
        return 2
    if not torch.cuda.is_available() or torch.cuda.device_count() < args.world:
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        print(f"FAIL: need {args.world} GPUs, have {n}")
        return 2
    for i in range(args.world):
        for j in range(args.world):
            if i != j and not torch.cuda.can_device_access_peer(i, j):
                print(f"note: torch says GPU {i} cannot access GPU {j} (P2P); expect FAIL")
    env = {k: os.environ.get(k) for k in sorted(os.environ) if k.startswith(("NVSHMEM", "NCCL"))}
    print(f"world={args.world} block={args.mib} MiB env={env}", flush=True)

    nbytes = args.mib << 20
    ctx = mp.start_processes(
        _worker,
        args=(args.world, _free_port(), nbytes, args.timeout),
        nprocs=args.world,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + args.timeout
    try:
        while not ctx.join(timeout=2):
            if time.monotonic() > deadline:
                print(f"FAIL: TIMEOUT after {args.timeout:.0f}s; killing ranks", flush=True)
                for p in ctx.processes:
                    if p.is_alive():
                        p.terminate()
                time.sleep(3)
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                return 3
    except (mp.ProcessExitedException, mp.ProcessRaisedException) as exc:
        # A rank exited non-zero; start_processes has already stopped the others.
        print(f"FAIL: {str(exc).strip()}", flush=True)
        return 1
    print(f"ALL {args.world} RANKS PASS", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
