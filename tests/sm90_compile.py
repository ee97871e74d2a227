"""Compile every kernel for sm_90 with Triton's own ptxas, on a machine without a GPU.

Run as a script (``python tests/sm90_compile.py [--low-latency]``) without TRITON_INTERPRET,
because the interpreter replaces ``triton.jit``; ``--low-latency``: only the low-latency
kernels, at EP2 and EP8, each with its branches that depend on a read each thread makes for
itself (``per_warp_decisions``). Compiles the launch shapes of EP2 and EP8 within one node
and of EP16 as 2 nodes of 8, whose kernels link NVSHMEM's sm_90 device bitcode as pip installs
it, and prints one line per kernel (dispatch and its layout also with one row per token,
expand=False, and combine summing token rows' topk_weights back; dispatch of FP8 rows at
EP8, with token rows at EP16; quantizing, and an exact-mode
move whose outputs come from the host, at EP2; the MXFP8 / NVFP4 quantizer once per format) with
ptxas' resource usage
(registers, and STACK: bytes spilled) and a digest of its machine code (identical digests:
identical code, e.g. before and after a change that should not change it); any compile or link
error fails. Integer arguments that
the JIT would specialise as multiples of 16 (pointers, hidden sizes, strides) are marked so.
The builds (40) compile side by side on every core first, into Triton's cache, which the
printing pass then reads.
"""

import hashlib
import inspect
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from hybrid_ep_triton.kernels.combine import combine_kernel
from hybrid_ep_triton.kernels.dispatch import dispatch_kernel
from hybrid_ep_triton.kernels.low_latency import (
    low_latency_combine_kernel,
    low_latency_dispatch_kernel,
)
from hybrid_ep_triton.kernels.peers import farewell_kernel
from hybrid_ep_triton.kernels.quantize import NO_QUANTIZER, quantize_block_scaled_kernel
from hybrid_ep_triton.kernels.route import layout_kernel
from hybrid_ep_triton.kernels.token_counts import token_counts_kernel
from hybrid_ep_triton.ops.dispatch import QUANTIZERS
from hybrid_ep_triton.runtime.nvshmem_bitcode import device_library
from hybrid_ep_triton.runtime.planner import (
    LOCAL_PARTS,
    MAX_PROGRAMS,
    MAX_REGISTERS,
    default_config,
    make_plan,
)

SM90 = GPUTarget("cuda", 90, 32)
_ALIGNED_INTS = {"hidden", "data_cols", "x_stride", "y_stride"}
_INT64 = {"timeout_ns", "heap_bytes", "report_addr", "outputs_addr"}


def _signature(kernel, pointers: dict, constexprs: dict) -> tuple[dict, dict]:
    signature, attrs = {}, {}
    for index, name in enumerate(inspect.signature(kernel.fn).parameters):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        if name.endswith("_ptr"):
            signature[name] = pointers.get(name, "*i32")
        else:
            signature[name] = "i64" if name in _INT64 else "i32"
        if name.endswith("_ptr") or name in _ALIGNED_INTS:
            attrs[(index,)] = [["tt.divisibility", 16]]
    return signature, attrs


def _resource_usage(cubin: bytes) -> str:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run(
            [tool, "--dump-resource-usage", f.name], capture_output=True, text=True
        )
    return " ".join(line.strip() for line in out.stdout.splitlines() if "REG:" in line)


def _sass_digest(cubin: bytes) -> str:
    """A digest of the kernel's machine code (cuobjdump -sass: instructions, no line tables), so
    that two builds of the same kernel can be told identical or not."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True)
    return hashlib.sha256(out.stdout.encode()).hexdigest()[:16]


_REGISTER = re.compile(r"%[a-z]+[0-9]+")
# Writes and control: no register of theirs is defined by a read.
_NO_DEFINITION = ("st.", "bar.sync", "bar.warp", "bra", "red.", "fence", "membar", "ret")


def per_warp_decisions(ptx: str) -> list[str]:
    """The source lines of the conditional branches in ``ptx`` that depend on a value each
    thread reads for itself from memory that changes while the kernel runs (a volatile load) or
    from the clock: warps that read it at different moments can part ways, and then meet at
    the wrong barriers (kernels/primitives.py, read_uniform and block_any). Data flow through
    registers, every definition of a register at once (PTX reuses registers across a loop);
    shared-memory loads (Triton's broadcasts), atomics (performed once and broadcast) and
    ``bar.red`` (one answer for the block) end it."""
    definitions: dict[str, list[tuple[str, list[str]]]] = {}
    branches = []
    where = ""
    for line in ptx.splitlines():
        line, _, comment = line.partition("//")
        line = line.strip()
        if line.startswith(".loc"):
            where = comment.strip()  # file:line:column, then where it was inlined
            continue
        if "bar.red" in line:  # block_any's asm: its result is the block's
            for reg in _REGISTER.findall(line.split("selp")[-1])[:1]:
                definitions.setdefault(reg, []).append(("uniform", []))
            continue
        for instruction in line.strip("{} ").split(";"):
            words = instruction.strip().split(None, 1)
            if words and words[0].startswith("@"):
                guard, words = words[0].lstrip("@!"), instruction.strip().split(None, 2)[1:]
            else:
                guard = None
            if len(words) < 2 or words[0].startswith((".", "$")):
                continue
            op, operands = words
            registers = _REGISTER.findall(operands) + ([guard] if guard else [])
            if op.startswith("bra") and guard:
                branches.append((where, guard))
            if op.startswith(_NO_DEFINITION):
                continue
            first = re.match(r"\s*(\{[^}]*\}|%[a-z]+[0-9]+)", operands)
            targets = _REGISTER.findall(first.group(1)) if first else []
            if op.startswith(("ld.shared", "ld.param", "atom")):
                kind = "uniform"
            elif op.startswith("ld.volatile") or "%globaltimer" in operands:
                kind = "per-warp"
            else:
                kind = "derived"
            sources = [reg for reg in registers if reg not in targets] if kind == "derived" else []
            for reg in targets:
                definitions.setdefault(reg, []).append((kind, sources))

    def per_warp(reg: str, seen: set) -> bool:
        if reg in seen:
            return False
        seen.add(reg)
        return any(
            kind == "per-warp" or any(per_warp(src, seen) for src in sources)
            for kind, sources in definitions.get(reg, [])
        )

    return sorted({where for where, guard in branches if per_warp(guard, set())})


TOPOLOGIES = ((2, 2), (8, 8), (16, 8))  # (world, ranks per node)


def compile_all(topologies=TOPOLOGIES):
    """Yield (label, CompiledKernel) for every build at each (world, ranks per node)."""
    for label, source, options in builds(topologies):
        yield label, triton.compile(source, target=SM90, options=options)


def builds(topologies=TOPOLOGIES):
    """Yield (label, ASTSource, options) of every build at each (world, ranks per node), then
    of the block-scaled quantizer's and of token_counts'."""
    i64 = {n: "*i64" for n in ("peer_bases_ptr", "control_ptr", "info_ptr", "net_bases_ptr")}
    i64["tokens_per_expert_ptr"] = "*i64"
    # The heuristic's launch shape for S1 (4096 tokens per rank, hidden 7168).
    cfg = default_config(7168, 4096, None, on_gpu=True)
    # EP2 and EP8 within one node; EP16 as 2 nodes of 8, whose kernels call NVSHMEM.
    for world, per_node in topologies:
        plan = make_plan(world, 7168, 4096, 256, torch.bfloat16, cfg, ranks_per_node=per_node)
        nodes = world // per_node
        topology = dict(R=per_node, R_P2=per_node, NODES=nodes, N_P2=max(nodes, 1))
        slot = dict(
            META_INTS=plan.net_slot.meta_ints,
            META_FLOATS=plan.net_slot.meta_floats,
            NET_COLS=plan.net_slot.cols,
            DATA_OFF=plan.net_slot.data_offset,
            SLOT_BYTES=plan.net_slot.bytes,
        )
        # Every constexpr of the data-move kernels; each kernel takes the ones it declares.
        common = dict(
            T_MAX=4096,
            NC_MAX=plan.max_chunks,
            H_SLICES=cfg.h_slices,
            P_MAX=MAX_PROGRAMS,
            MS=plan.meta_stride,
            MS_P2=plan.meta_stride,
            W_P2=world,
            W=world,
            CHUNK=cfg.chunk_tokens,
            K_P2=8,
            HAS_WEIGHTS=True,
            WRITE_ROWS=True,
            SLOT_WEIGHTS=False,
            SW=32,
            COPY_UNROLL=cfg.copy_unroll,
            LP_MAX=LOCAL_PARTS,
            STAGES=cfg.copy_stages,
            SCALE_WORDS=0,
            QUANTIZE=NO_QUANTIZER.value,
            CHANNEL_GROUPS=0,
            OUTPUTS_FROM_HOST=False,
            **topology,
            **slot,
        )
        tokens = dict(
            i64,
            x_ptr="*bf16",
            topk_idx_ptr="*i64",
            topk_weights_ptr="*fp32",
            recv_x_ptr="*bf16",
            recv_weights_ptr="*fp32",
            quantized_flags_ptr="*i64",
        )
        layout = dict(
            CHUNK=cfg.chunk_tokens,
            K_P2=8,
            W_P2=world,
            E_P2=256,
            L_P2=256 // world,
            PAIRS=128,
            NC_MAX=plan.max_chunks,
            ROW=plan.counts_row,
            LR=plan.layout_row,
            C_BLOCK=32,
            TABLE_BLOCK=256,
            **topology,
        )
        partials = dict(
            i64, y_ptr="*bf16", weights_ptr="*fp32", outbox_ptr="*bf16", out_ptr="*bf16"
        )
        # FP8 rows move as int32 words: data words, then the scale words (planner.ScaledRows).
        fp8 = plan.scaled_rows("fp8")
        fp8_tokens = dict(
            tokens, x_ptr="*i32", recv_x_ptr="*i32", x_scales_ptr="*i32", recv_scales_ptr="*i32"
        )
        fp8_constexprs = dict(
            common, BLOCK_H=fp8.block, NET_COLS=fp8.net_cols, SCALE_WORDS=fp8.scale_words
        )
        builds = [
            *(
                (layout_kernel, dict(i64, topk_idx_ptr="*i64"), dict(layout, TOKEN_ROWS=rows), 4)
                for rows in (False, True)
            ),
            *(
                (
                    dispatch_kernel,
                    tokens,
                    dict(common, BLOCK_H=cfg.block_h, TOKEN_ROWS=rows),
                    cfg.num_warps,
                )
                for rows in (False, True)
            ),
            *(
                (
                    combine_kernel,
                    partials,
                    dict(
                        common,
                        BLOCK_H=cfg.combine_block_h,
                        COPY_BLOCK_H=cfg.block_h,
                        SLOT_WEIGHTS=slots,
                    ),
                    cfg.num_warps,
                )
                for slots in (False, True)
            ),
            # FP8 rows: expert-major at EP8, token rows across nodes (each build costs ~20 s).
            *(
                (
                    dispatch_kernel,
                    fp8_tokens,
                    dict(fp8_constexprs, TOKEN_ROWS=nodes > 1),
                    cfg.num_warps,
                )
                for _ in range(world > 2)
            ),
            # Quantizing as it sends, from bf16 rows, into each format: expert-major at EP2.
            *(
                (
                    dispatch_kernel,
                    dict(fp8_tokens, source_ptr="*bf16"),
                    dict(
                        common,
                        BLOCK_H=layout.block,
                        NET_COLS=layout.net_cols,
                        SCALE_WORDS=layout.scale_words,
                        TOKEN_ROWS=False,
                        QUANTIZE=QUANTIZERS[name],
                        CHANNEL_GROUPS=7168 // 128,
                    ),
                    cfg.num_warps,
                )
                for name in QUANTIZERS
                if world == 2
                for layout in (plan.scaled_rows(name),)
            ),
            # An exact-mode move, its outputs from the host's record: expert-major at EP2.
            *(
                (
                    dispatch_kernel,
                    tokens,
                    dict(common, BLOCK_H=cfg.block_h, TOKEN_ROWS=False, OUTPUTS_FROM_HOST=True),
                    cfg.num_warps,
                )
                for _ in range(world == 2)
            ),
        ]
        for kernel, pointers, constexprs, num_warps in builds:
            # As launched: the data moves capped at MAX_REGISTERS, the layout kernel uncapped;
            # across nodes with NVSHMEM's device library linked.
            options = dict(num_warps=num_warps)
            if kernel in (dispatch_kernel, combine_kernel):
                options["maxnreg"] = MAX_REGISTERS
            if nodes > 1:
                options["extern_libs"] = device_library(arch="90")
            params = inspect.signature(kernel.fn).parameters
            constexprs = {k: v for k, v in constexprs.items() if k in params}
            signature, attrs = _signature(kernel, pointers, constexprs)
            rows = " (token rows)" if constexprs.get("TOKEN_ROWS") else ""
            rows += " (token rows' topk_weights)" if constexprs.get("SLOT_WEIGHTS") else ""
            quantizer = {code: name for name, code in QUANTIZERS.items()}.get(
                constexprs.get("QUANTIZE")
            )
            rows += f" quantizing into {quantizer}" if quantizer else ""
            rows += " FP8" if constexprs.get("SCALE_WORDS") and not quantizer else ""
            rows += " (outputs from the host)" if constexprs.get("OUTPUTS_FROM_HOST") else ""
            topo = f"EP{world}" if nodes == 1 else f"EP{world} ({nodes}x{per_node}, NVSHMEM)"
            source = ASTSource(kernel, signature, constexprs, attrs)
            yield f"{topo} {kernel.fn.__name__}{rows}", source, options
        yield from low_latency_builds(world, per_node)
    yield from block_scaled_builds()
    yield from token_counts_builds()


def low_latency_builds(world: int, per_node: int):
    """Yield (label, ASTSource, options) of the low-latency kernels at 128 tokens a rank, as
    ops/low_latency.py launches them without a hook: dispatch of bf16 rows and of FP8 rows with
    UE8M0 scales, combine, and destroy()'s farewell."""
    from hybrid_ep_triton.ops import low_latency as ops
    from hybrid_ep_triton.runtime.planner import low_latency_layout, next_power_of_2

    ll = low_latency_layout(128, 7168, world, 256, torch.bfloat16)
    nodes = world // per_node
    common = dict(
        W=world,
        L=256 // world,
        B=ll.remote_blocks,
        M=ll.tokens,
        S=ll.slices,
        K=8,
        K_P2=8,
        ROWS=ops._TILE_ROWS,
        STAGES=ops._STAGES,
        ROW_BYTES=ll.row_bytes,
        ALIGNED=True,
        NODES=nodes,
        SEND=True,
        RECEIVE=True,
    )
    heap = dict(
        peer_bases_ptr="*i64",
        net_bases_ptr="*i64",
        control_ptr="*i64",
        seq_ptr="*i64",
        layout_range_ptr="*i64",
        x_ptr="*bf16",
        topk_ptr="*i64",
    )
    options = dict(num_warps=ops._WARPS)
    if nodes > 1:
        options["extern_libs"] = device_library(arch="90")
    topo = f"EP{world}" if nodes == 1 else f"EP{world} ({nodes}x{per_node}, NVSHMEM)"
    kernel = low_latency_dispatch_kernel
    for label, fp8 in (("", False), (" FP8 UE8M0", True)):
        constexprs = dict(
            common,
            SCAN=1024,
            GROUPS=ops.token_groups(fp8),
            G_P2=64,
            QC_P2=next_power_of_2(ll.token_chunks),
            FP8=fp8,
            ROUND=fp8,
            UE8M0=fp8,
            HAS_STATS=True,
            BLOCK_H=ops._BLOCK_H,
        )
        pointers = dict(heap, scales_ptr="*u8" if fp8 else "*fp32", recv_ptr="*u8")
        signature, attrs = _signature(kernel, pointers, constexprs)
        yield (
            f"{topo} {kernel.fn.__name__}{label}",
            ASTSource(kernel, signature, constexprs, attrs),
            options,
        )
    kernel = low_latency_combine_kernel
    params = inspect.signature(kernel.fn).parameters
    constexprs = dict(common, ZERO_COPY=False, BLOCK_H=ops._COMBINE_BLOCK_H, PARTS=ops._SUM_PARTS)
    constexprs = {k: v for k, v in constexprs.items() if k in params}
    pointers = dict(heap, weights_ptr="*fp32", out_ptr="*bf16")
    signature, attrs = _signature(kernel, pointers, constexprs)
    yield f"{topo} {kernel.fn.__name__}", ASTSource(kernel, signature, constexprs, attrs), options
    kernel = farewell_kernel
    constexprs = dict(W=world, W_P2=world, NODES=nodes)
    signature, attrs = _signature(kernel, dict(heap, verdict_ptr="*i64"), constexprs)
    yield f"{topo} {kernel.fn.__name__}", ASTSource(kernel, signature, constexprs, attrs), options


def block_scaled_builds():
    """Yield (label, ASTSource, options) of the MXFP8 / NVFP4 quantizer of bf16 rows, as
    ops.quantize launches it: MXFP8, NVFP4, NVFP4 with a per-tensor scale."""
    kernel = quantize_block_scaled_kernel
    pointers = dict(x_ptr="*bf16", values_ptr="*u8", scales_ptr="*u8", per_tensor_scale_ptr="*fp32")
    for label, nvfp4, per_tensor in (
        ("MXFP8", False, False),
        ("NVFP4", True, False),
        ("NVFP4 per-tensor scale", True, True),
    ):
        constexprs = dict(BLOCK_T=16, GROUPS=8, NVFP4=nvfp4, PER_TENSOR_SCALE=per_tensor)
        signature, attrs = _signature(kernel, pointers, constexprs)
        source = ASTSource(kernel, signature, constexprs, attrs)
        yield f"{kernel.fn.__name__} {label}", source, {}


def token_counts_builds():
    """Yield (label, ASTSource, options) of Buffer.token_counts's kernel at EP16 as 2 nodes of
    8 (DeepEP's get_dispatch_layout), int64 ids."""
    kernel = token_counts_kernel
    constexprs = dict(W=16, NODES=2, W_P2=16, N_P2=2, BLOCK=64)
    pointers = dict(topk_idx_ptr="*i64", token_in_rank_ptr="*u8")
    signature, attrs = _signature(kernel, pointers, constexprs)
    yield f"{kernel.fn.__name__} EP16 (2x8)", ASTSource(kernel, signature, constexprs, attrs), {}


def _compile_build(index: int) -> None:
    """In a worker: compile build ``index`` of builds() into Triton's cache."""
    _, source, options = list(builds())[index]
    triton.compile(source, target=SM90, options=options)


def main() -> int:
    if sys.argv[1:] == ["--low-latency"]:
        # Only the low-latency kernels, at EP2 and EP8 in one node, one after another: the
        # quick check that a Triton version compiles them (kernels/low_latency.py).
        for world, per_node in ((2, 2), (8, 8)):
            for label, source, options in low_latency_builds(world, per_node):
                compiled = triton.compile(source, target=SM90, options=options)
                decisions = per_warp_decisions(compiled.asm["ptx"])
                print(
                    f"{label}: {_resource_usage(compiled.asm['cubin'])} "
                    f"per-warp-decisions:{len(decisions)}"
                )
                for where in decisions:
                    print(f"    {where}")
        return 0
    # Into Triton's cache side by side on every core, those that link NVSHMEM (the slowest)
    # first; then each build again here, a cache hit, for its machine code.
    linked = [bool(options.get("extern_libs")) for _, _, options in builds()]
    order = sorted(range(len(linked)), key=lambda i: not linked[i])
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(os.cpu_count(), mp_context=context) as pool:
        list(pool.map(_compile_build, order))
    for label, compiled in compile_all():
        usage = _resource_usage(compiled.asm["cubin"])
        cubin = compiled.asm["cubin"]
        print(
            f"{label}: {usage} cp.async:{compiled.asm['ptx'].count('cp.async.cg')} "
            f"sass:{_sass_digest(cubin)}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
