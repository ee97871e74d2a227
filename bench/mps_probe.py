"""What a CUDA context under an MPS share reports and can run (one GPU, MPS daemon running):

    python3 bench/mps_probe.py --shares 100,50,25,12

For each CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, a fresh process prints the SM counts that torch
(multi_processor_count), the runtime (cudaDevAttrMultiProcessorCount) and the context's
execution affinity (cuCtxGetExecAffinity, SM count) report, and what a launch really gets: a
Triton kernel of 4 programs per reported SM, each spinning SPIN_NS on the clock, records its
SM (%smid) and its start and end (%globaltimer); the distinct SMs and the most programs
running at once are printed. Also the device memory NVSHMEM takes at init and for a block.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

SPIN_NS = 200_000


def _probe_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def spin(out_ptr, spin_ns):
        pid = tl.program_id(0)
        smid = tl.inline_asm_elementwise(
            "mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1
        )
        start = tl.inline_asm_elementwise(
            "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
        )
        now = start
        while now - start < spin_ns:
            now = tl.inline_asm_elementwise(
                "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
            )
        tl.store(out_ptr + pid * 3, smid.to(tl.int64))
        tl.store(out_ptr + pid * 3 + 1, start)
        tl.store(out_ptr + pid * 3 + 2, now)

    return spin


def _most_at_once(spans) -> int:
    events = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans])
    most = running = 0
    for _, step in events:
        running += step
        most = max(most, running)
    return most


def child(num_warps: int) -> None:
    import torch
    from cuda.bindings import driver, runtime

    torch.cuda.init()
    props = torch.cuda.get_device_properties(0)
    err, attr = runtime.cudaDeviceGetAttribute(
        runtime.cudaDeviceAttr.cudaDevAttrMultiProcessorCount, 0
    )
    torch.zeros(1, device="cuda")  # the primary context is current from here
    derr, aff = driver.cuCtxGetExecAffinity(
        driver.CUexecAffinityType.CU_EXEC_AFFINITY_TYPE_SM_COUNT
    )
    affinity = aff.param.smCount.val if derr == driver.CUresult.CUDA_SUCCESS else str(derr)
    spin = _probe_kernel()
    programs = 4 * props.multi_processor_count
    out = torch.zeros(programs, 3, dtype=torch.int64, device="cuda")
    spin[(programs,)](out, SPIN_NS, num_warps=num_warps)
    torch.cuda.synchronize()
    rows = out.cpu().tolist()
    print(
        json.dumps(
            {
                "share": os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"),
                "torch_sms": props.multi_processor_count,
                "runtime_sms": attr if err == runtime.cudaError_t.cudaSuccess else str(err),
                "affinity_sms": affinity,
                "programs": programs,
                "num_warps": num_warps,
                "distinct_sms": len({r[0] for r in rows}),
                "most_at_once": _most_at_once([(r[1], r[2]) for r in rows]),
            }
        ),
        flush=True,
    )


def nvshmem_child() -> None:
    import torch
    import torch.distributed as dist

    from hybrid_ep_triton.runtime.nvshmem import NvshmemAllocation

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29533", rank=0, world_size=1)
    torch.cuda.set_device(0)
    free0 = torch.cuda.mem_get_info()[0]
    block = NvshmemAllocation(None, 1 << 30, torch.device("cuda", 0), ranks_per_node=1)
    free1 = torch.cuda.mem_get_info()[0]
    print(
        json.dumps(
            {
                "NVSHMEM_SYMMETRIC_SIZE": os.environ.get("NVSHMEM_SYMMETRIC_SIZE"),
                "taken_by_init_and_1GiB_block_MiB": (free0 - free1) >> 20,
            }
        ),
        flush=True,
    )
    block.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shares", default="100,50,25,12")
    p.add_argument("--warps", type=int, default=8)
    p.add_argument("--child", action="store_true")
    p.add_argument("--nvshmem", action="store_true")
    args = p.parse_args()
    if args.child:
        return child(args.warps)
    if args.nvshmem:
        return nvshmem_child()
    for share in args.shares.split(","):
        env = dict(os.environ, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=share)
        subprocess.run([sys.executable, __file__, "--child", "--warps", str(args.warps)],
                       env=env, timeout=120, check=False)  # fmt: skip
    for size in ("2G", "16G"):
        env = dict(os.environ, NVSHMEM_SYMMETRIC_SIZE=size)
        subprocess.run([sys.executable, __file__, "--nvshmem"], env=env, timeout=120, check=False)


if __name__ == "__main__":
    main()
