"""The ``hybrid-ep demo`` rank body: one mixture-of-experts layer, end to end.

Every rank routes its tokens, dispatches them to the experts' ranks with ``Buffer.dispatch``,
runs its local experts on the rows it received, and sends the results back with
``Buffer.combine``. The same round through ``hybrid_ep_triton.reference`` (plain
``all_to_all``) checks it: the dispatch must match bit for bit, the layer's output to bf16
precision. Rank 0 gathers every rank's numbers and prints a table.

``demo_rank(rank, world_size, config)`` only needs an initialised default process group (NCCL
with one GPU per rank, or gloo on CPU under ``TRITON_INTERPRET=1``), so it also runs under
``torchrun``; the CLI starts it through ``hybrid_ep_triton.tools.launcher.run_ranks``, also with
ranks sharing GPUs (gloo, under CUDA MPS): ``launcher.rank_device`` says where tokens live.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import reference
from ..buffer import Buffer
from .launcher import rank_device

FFN_HIDDEN = 256  # inner width of each expert's MLP
DTYPE = torch.bfloat16
RTOL = 1.6e-2  # bf16 rounding, relative to the output's largest magnitude (see _close)


@dataclass(frozen=True)
class DemoConfig:
    tokens: int  # tokens per rank
    hidden: int
    experts: int  # global experts, a multiple of the number of ranks
    topk: int
    seed: int = 0
    ranks_per_node: int | None = None  # the Buffer's: nodes of that many ranks (None: hosts)


def demo_rank(rank: int, world_size: int, cfg: DemoConfig) -> bool:
    """One MoE round on this rank; returns whether it matched the reference."""
    device = rank_device()
    on_gpu = device.type == "cuda"
    local_experts = cfg.experts // world_size

    # Tokens of this rank, and a router shared by all ranks (same seed).
    g = generator(device, cfg.seed + 1 + rank)
    x = torch.randn(cfg.tokens, cfg.hidden, generator=g, device=device).to(DTYPE)
    g = generator(device, cfg.seed)
    router = torch.randn(cfg.hidden, cfg.experts, generator=g, device=device) / cfg.hidden**0.5
    probs = torch.softmax(x.float() @ router, dim=-1)
    topk_weights, topk_idx = probs.topk(cfg.topk, dim=-1)
    topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)  # float32 [T, K]

    # This rank's experts: global experts [rank * L, (rank + 1) * L), each a 2-layer MLP.
    g = generator(device, cfg.seed + 1000 + rank)
    w_in = torch.randn(local_experts, cfg.hidden, FFN_HIDDEN, generator=g, device=device)
    w_out = torch.randn(local_experts, FFN_HIDDEN, cfg.hidden, generator=g, device=device)
    w_in = (w_in / cfg.hidden**0.5).to(DTYPE)
    w_out = (w_out / FFN_HIDDEN**0.5).to(DTYPE)

    def experts(recv_x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        # recv_x is grouped by local expert: segment e has tokens_per_expert[e] rows.
        segments = recv_x.split(tokens_per_expert.tolist())
        return torch.cat([F.silu(seg @ w_in[e]) @ w_out[e] for e, seg in enumerate(segments)])

    # Collective: sizes the symmetric buffers for max_tokens_per_rank tokens from every rank.
    buffer = Buffer(
        None,
        hidden_size=cfg.hidden,
        max_tokens_per_rank=cfg.tokens,
        num_experts=cfg.experts,
        dtype=DTYPE,
        ranks_per_node=cfg.ranks_per_node,
        device=device,
    )

    if on_gpu:  # a warm-up round compiles the kernels
        recv_x, recv_weights, tokens_per_expert, handle = buffer.dispatch(x, topk_idx, topk_weights)
        buffer.combine(experts(recv_x, tokens_per_expert), handle, weights=recv_weights)

    # The timed round, step by step.
    (recv_x, recv_weights, tokens_per_expert, handle), dispatch_ms = _timed(
        on_gpu, lambda: buffer.dispatch(x, topk_idx, topk_weights)
    )
    y = experts(recv_x, tokens_per_expert)
    out, combine_ms = _timed(on_gpu, lambda: buffer.combine(y, handle, weights=recv_weights))

    # The same round through the plain-torch reference.
    ref_x, ref_weights, ref_tpe, ref_handle = reference.dispatch(
        None, x, topk_idx, topk_weights, num_experts=cfg.experts
    )
    ref_out = reference.combine(None, experts(ref_x, ref_tpe), ref_handle, weights=ref_weights)

    problems = []
    same = [(recv_x, ref_x), (recv_weights, ref_weights), (tokens_per_expert, ref_tpe)]
    if not all(torch.equal(a, b) for a, b in same):
        problems.append("dispatch differs")
    err = (out.float() - ref_out.float()).abs().max().item() if out.numel() else 0.0
    if not _close(out, ref_out):
        problems.append(f"combine off by {err:.3g}")

    # A token crosses to each rank holding one of its experts once, however many experts it
    # picked there, and its partial sum comes back once: rows_in rows of H elements each way.
    rows_in = sum(ref_handle.recv_splits)  # (token, source rank) rows received, self included
    stats = {
        "rank": rank,
        "tokens": cfg.tokens,
        "rows": recv_x.shape[0],
        "tokens_per_expert": tokens_per_expert.tolist(),
        "bytes": 2 * rows_in * cfg.hidden * recv_x.element_size(),
        "dispatch_ms": dispatch_ms,
        "combine_ms": combine_ms,
        "max_err": err,
        "problems": problems,
    }
    buffer.destroy()

    everyone = [None] * world_size if rank == 0 else None
    dist.gather_object(stats, everyone, dst=0)
    if rank == 0:
        _print_table(everyone, on_gpu)
    return not problems


def generator(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def _timed(on_gpu: bool, fn):
    """(fn(), milliseconds), all ranks starting together; CUDA events on GPUs."""
    if on_gpu:
        torch.cuda.synchronize()
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        result = fn()
        end.record()
        end.synchronize()
        return result, start.elapsed_time(end)
    dist.barrier()
    t0 = time.perf_counter()
    result = fn()
    return result, (time.perf_counter() - t0) * 1e3


def _close(out: torch.Tensor, ref: torch.Tensor) -> bool:
    """Within bf16 rounding: the combine adds bf16 partials where the reference adds fp32."""
    if out.numel() == 0:
        return True
    ref = ref.float()
    tol = RTOL * (ref.abs() + ref.abs().max())
    return bool(((out.float() - ref).abs() <= tol).all())


# -- the table ----------------------------------------------------------------------------


def _print_table(stats: list[dict], on_gpu: bool) -> None:
    columns = ["rank", "tokens", "rows recv", "tokens / local expert", "bytes moved"]
    columns += ["dispatch ms", "combine ms", "check"]
    rows = [
        [
            str(s["rank"]),
            str(s["tokens"]),
            str(s["rows"]),
            _abbreviate(s["tokens_per_expert"]),
            human_bytes(s["bytes"]),
            f"{s['dispatch_ms']:.2f}",
            f"{s['combine_ms']:.2f}",
            "; ".join(s["problems"]) or "OK",
        ]
        for s in stats
    ]
    clock = (
        "CUDA events, after a warm-up round"
        if on_gpu
        else "CPU wall time under the Triton interpreter, not a speed measure"
    )
    worst = max(s["max_err"] for s in stats)
    notes = [
        f"times: {clock}",
        f"bytes moved: (token, destination rank) rows received x hidden x {DTYPE.itemsize} B, "
        "dispatch + combine",
        f"check: dispatch bit-exact and combine within bf16 rounding (max |err| {worst:.3g}) "
        "against hybrid_ep_triton.reference",
    ]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(columns)]
        print("  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True)))
        for r in rows:
            print("  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)))
        print("\n".join(notes), flush=True)
        return
    table = Table(*columns, title="hybrid-ep demo: one MoE layer")
    for r in rows:
        table.add_row(*r, style=None if r[-1] == "OK" else "bold red")
    console = Console(width=max(Console().width, 120))
    console.print(table)
    console.print("\n".join(notes), style="dim", highlight=False)


def _abbreviate(counts: list[int], limit: int = 8) -> str:
    if len(counts) <= limit:
        return " ".join(map(str, counts))
    head = " ".join(map(str, counts[: limit - 2]))
    return f"{head} ... {counts[-1]} ({len(counts)}, {min(counts)}-{max(counts)})"


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"
