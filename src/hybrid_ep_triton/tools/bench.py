"""Benchmark of dispatch and combine on the local GPUs (``hybrid-ep bench``, ``nox -s bench``).

One run measures, on every rank at once:
- the ceiling: copy-engine peer copies to the next GPU, every GPU sending at the same time;
- Buffer.dispatch (exact, max_recv_tokens and cached-handle modes) and Buffer.combine for each
  SM count, on S1 (4096 tokens per rank, hidden 7168, top-8 of 256 experts, bf16), S2 (128
  tokens, same model) and spot checks at hidden 2880 and 4096; on S1 and S2 both with
  expert-major rows (the default) and with one row per token (expand=False, DeepEP's output);
- the baseline: ``hybrid_ep_triton.reference`` over NCCL on the same inputs.
- block-scaled dispatch (S1 and S2, both layouts, every SM count, beside the bf16 rows of the
  same Buffer): rows "fp8", "mxfp8" and "nvfp4" pass the format's (values, scales) pair, rows
  "<format>-quantize" pass bf16 rows with quantize=<format>; exact, cached and graph modes; and
  each quantizing copy alone beside a plain copy of the same bf16 rows ("copies": bytes read
  and written over the kernel's time, triton.testing.do_bench's median).
Each configuration is first checked against the reference (dispatch bit-exact, FP8 too,
combine within bf16 tolerance). Times are CUDA events around the whole call on the calling
stream, the median of ``iters`` calls after ``warmup`` calls, input sets rotated; the reported
time is the largest of the ranks' medians.
algo_GBps: (token, destination rank) rows received, local ones included, x the bytes of a row
(bf16: 2 x hidden; FP8: hidden + 4 x hidden / 128), over time (DeepEP's metric). nvlink_GBps:
the bytes of those rows that crossed between GPUs, over time. With ``--ranks-per-node R`` (R
below the group size) S1 and S2 run again with the GPUs split into nodes of R (every transfer
between nodes an NVSHMEM put issued by the kernels), in the same run: net_rows is the token
rows a rank's dispatch puts over the network (the kernels count them), net_GBps their bytes
over the whole call's time. Results go to
``<out>/<date>-<machine>-ep<N>.{json,md,png}``.
"""

import argparse
import datetime
import importlib.metadata
import json
import os
import statistics
import subprocess
import time
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist

from .launcher import run_ranks


@dataclass(frozen=True)
class Shape:
    name: str
    tokens: int
    hidden: int
    topk: int = 8
    experts: int = 256


SHAPES = {
    "S1": Shape("S1", 4096, 7168),
    "S2": Shape("S2", 128, 7168),
    "H2880": Shape("H2880", 4096, 2880),
    "H4096": Shape("H4096", 4096, 4096),
}
_ROTATE = 4  # input sets cycled through while timing
_CEILING_BYTES = 256 << 20
_PLOTTED = (  # op, mode, expand, line style
    ("dispatch", "exact", True, "o-"),
    ("dispatch", "graph", True, "o--"),
    ("combine", "exact", True, "s-"),
    ("combine", "graph", True, "s--"),
    ("dispatch", "graph", False, "^:"),
    ("combine", "graph", False, "v:"),
)


def median_us(fn, args_list, warmup: int, iters: int) -> tuple[float, float]:
    """(device time, host time) per call in µs: the largest over ranks of the medians of
    event-timed calls, and of the host time spent issuing each call. On CPU ranks (gloo, the
    interpreter) calls are synchronous and both are the host time."""
    on_gpu = dist.get_backend() == "nccl"
    for i in range(warmup):
        fn(*args_list[i % len(args_list)])
    if on_gpu:
        torch.cuda.synchronize()
    dist.barrier()
    events, host = [], []
    # Events made before the loop and recorded on the stream found once: looking the stream up
    # per record is µs of host time, inside the measured span for the end event.
    if on_gpu:
        stream = torch.cuda.current_stream()
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(iters)
        ]
    for i in range(iters):
        t0 = time.perf_counter()
        if on_gpu:
            events[i][0].record(stream)
        fn(*args_list[i % len(args_list)])
        if on_gpu:
            events[i][1].record(stream)
        host.append((time.perf_counter() - t0) * 1e6)
    if on_gpu:
        torch.cuda.synchronize()
    device = [s.elapsed_time(e) * 1e3 for s, e in events] if on_gpu else host
    return tuple(_largest_over_ranks([statistics.median(device), statistics.median(host)]))


def _largest_over_ranks(values: list[float]) -> list[float]:
    """Each of ``values``, the largest over the group's ranks (collective)."""
    on_gpu = dist.get_backend() == "nccl"
    worst = torch.tensor(values, device="cuda" if on_gpu else "cpu")
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return worst.tolist()


def capture(fn):
    """(CUDA graph of fn, fn's output from the capture); warmed up on a side stream first."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def _ceiling_gbps(rank: int, world: int, warmup: int, iters: int) -> float:
    """Copy-engine bandwidth to the next GPU, in GB/s per direction, all GPUs sending."""
    peer = torch.device("cuda", (rank + 1) % world)
    src = torch.randn(_CEILING_BYTES // 4, device="cuda")
    dst = torch.empty(_CEILING_BYTES // 4, device=peer)
    t, _ = median_us(lambda: dst.copy_(src, non_blocking=True), [()], warmup, iters)
    return _CEILING_BYTES / t / 1e3


def inputs(shape: Shape, rank: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed * 1000 + rank)
    x = torch.randn(shape.tokens, shape.hidden, device="cuda", generator=g).to(torch.bfloat16)
    scores = torch.rand(shape.tokens, shape.experts, device="cuda", generator=g)
    topk_idx = scores.topk(shape.topk, dim=1).indices
    weights = torch.rand(shape.tokens, shape.topk, device="cuda", generator=g)
    return x, topk_idx, weights


def _row_counts(topk_idx: torch.Tensor, world: int, experts: int) -> tuple[int, int]:
    """(token, destination rank) rows this rank receives, all and from other ranks."""
    local = experts // world
    hits = torch.zeros(topk_idx.shape[0], world, dtype=torch.int32, device=topk_idx.device)
    hits.scatter_(1, (topk_idx // local).long(), 1)
    per_dest = hits.sum(0)
    recv = torch.empty_like(per_dest)
    dist.all_to_all_single(recv, per_dest)
    total = int(recv.sum())
    return total, total - int(recv[dist.get_rank()])


def combine_weights(buf, outputs: tuple):
    """combine's per-row weights: recv_weights with expert-major rows; with token rows the
    caller has weighted its rows already (None)."""
    return outputs[1] if buf.expand else None


def _check(buf, reference, shape: Shape, x, topk_idx, weights) -> tuple[str | None, int]:
    """(what differs from the reference or None, rows the dispatch put over the network)."""
    sent = buf.network_rows
    *got, handle = buf.dispatch(x, topk_idx, weights)
    net_rows = buf.network_rows - sent
    *want, ref_handle = reference.dispatch(
        None, x, topk_idx, weights, num_experts=shape.experts, expand=buf.expand
    )
    if not all(torch.equal(a, b) for a, b in zip(got, want, strict=True)):
        return f"{shape.name}: dispatch differs from the reference", net_rows
    y = torch.randn_like(got[0])
    out = buf.combine(y, handle, weights=combine_weights(buf, got))
    ref_out = reference.combine(None, y, ref_handle, weights=combine_weights(buf, want))
    err = ((out.float() - ref_out.float()).norm() / ref_out.float().norm().clamp_min(1e-30)).item()
    if not err < 1e-2:
        return f"{shape.name}: combine relative error {err:.2e}", net_rows
    return None, net_rows


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _check_scaled(buf, reference, shape: Shape, fmt: str, x, topk_idx, weights) -> str | None:
    """What differs between a dispatch quantizing into ``fmt`` and the reference quantizer
    followed by the reference dispatch of values and scales (as bytes), or None."""
    (values, scales), *rest, _ = buf.dispatch(x, topk_idx, weights, quantize=fmt)
    want_values, want_scales = reference.QUANTIZERS[fmt](x)
    kw = dict(num_experts=shape.experts, expand=buf.expand)
    ref_values, *ref_rest, _ = reference.dispatch(
        None, _bytes(want_values), topk_idx, weights, **kw
    )
    ref_scales = reference.dispatch(None, _bytes(want_scales), topk_idx, weights, **kw)[0]
    if not torch.equal(_bytes(values), ref_values):
        return f"{shape.name}: {fmt} values differ from the reference"
    if not torch.equal(_bytes(scales), ref_scales):
        return f"{shape.name}: {fmt} scales differ from the reference"
    if not all(torch.equal(a, b) for a, b in zip(rest, ref_rest, strict=True)):
        return f"{shape.name}: {fmt} dispatch's weights or counts differ from the reference"
    return None


# Block-scaled formats: bytes a row of H channels crosses the links with.
SCALED_ROW_BYTES = {
    "fp8": lambda h: h + 4 * h // 128,
    "mxfp8": lambda h: h + h // 32,
    "nvfp4": lambda h: h // 2 + h // 16,
}


def _time_buffer(buf, sets, warmup: int, iters: int, rows: str = "bf16") -> dict:
    """{(op, mode): (device µs, host µs)} of one Buffer on the rotated input sets, with rows
    "bf16", a format's name ("fp8", "mxfp8", "nvfp4": the pair of each set's rows, from the
    reference quantizer) or "<format>-quantize" (quantize=<format>); the formats time dispatch
    only."""
    times = {}
    fmt, _, how = rows.partition("-")
    quantize = fmt if how == "quantize" else False
    if rows in SCALED_ROW_BYTES:
        from .. import reference

        sets = [(reference.QUANTIZERS[rows](x), i, w) for x, i, w in sets]
    exact = [buf.dispatch(x, i, w, quantize=quantize) for x, i, w in sets]
    max_rows = -(-max(out[-1].num_recv_rows for out in exact) * 11 // 10)  # 10% headroom

    def dispatch(x, i, w, **kwargs):
        return buf.dispatch(x, i, w, quantize=quantize, **kwargs)

    times["dispatch", "exact"] = median_us(dispatch, sets, warmup, iters)
    times["dispatch", "max_recv"] = median_us(
        partial(dispatch, max_recv_tokens=max_rows), sets, warmup, iters
    )
    cached = [(x, None, w) for x, _, w in sets]
    handles = [out[-1] for out in exact]
    times["dispatch", "cached"] = median_us(
        lambda k: dispatch(*cached[k], handle=handles[k]),
        [(k,) for k in range(len(sets))],
        warmup,
        iters,
    )
    if rows != "bf16":
        graphs = [
            capture(partial(dispatch, x, i, w, max_recv_tokens=max_rows))[0] for x, i, w in sets
        ]
        times["dispatch", "graph"] = median_us(
            lambda g: g.replay(), [(g,) for g in graphs], warmup, iters
        )
        return times
    combine_args = [(torch.randn_like(out[0]), out[-1], combine_weights(buf, out)) for out in exact]
    times["combine", "exact"] = median_us(
        lambda y, h, w: buf.combine(y, h, weights=w), combine_args, warmup, iters
    )
    # CUDA graphs (max_recv_tokens mode needs no host synchronisation): one graph per input
    # set, replayed in turn. A replay reads its inputs' memory: each graph's inputs stay
    # referenced with it (torch.cuda.graph frees unreferenced cached blocks at each capture).
    graphs = []
    for x, i, w in sets:
        g_disp, out = capture(partial(dispatch, x, i, w, max_recv_tokens=max_rows))
        g_disp.replay()  # capturing runs nothing: fill the handle before combine uses it
        y, h, rw = torch.randn_like(out[0]), out[-1], combine_weights(buf, out)
        g_comb, _ = capture(partial(buf.combine, y, h, weights=rw))
        graphs.append((g_disp, g_comb, (y, h, rw)))
    times["dispatch", "graph"] = median_us(lambda g, _, __: g.replay(), graphs, warmup, iters)
    times["combine", "graph"] = median_us(lambda _, g, __: g.replay(), graphs, warmup, iters)
    return times


def _time_copies(reference, x: torch.Tensor) -> list[dict]:
    """The quantizing copies (what a quantizing dispatch's quantizers do, as a kernel alone,
    for FP8, MXFP8 and NVFP4, and the FP8 reference quantizer in plain torch) beside a plain
    copy of the same bf16 rows: µs and GB/s of bytes read and written."""
    from ..ops.quantize import quantize_fp8, quantize_mxfp8, quantize_nvfp4

    tokens, hidden = x.shape
    bf16_bytes = 2 * tokens * hidden
    moved = {fmt: bf16_bytes + tokens * size(hidden) for fmt, size in SCALED_ROW_BYTES.items()}
    copies = [
        ("bf16 copy (torch clone)", torch.clone, 2 * bf16_bytes),
        ("quantize fp8, kernels/quantize.py", quantize_fp8, moved["fp8"]),
        ("quantize mxfp8, kernels/quantize.py", quantize_mxfp8, moved["mxfp8"]),
        ("quantize nvfp4, kernels/quantize.py", quantize_nvfp4, moved["nvfp4"]),
        ("quantize fp8, reference (torch)", reference.quantize_fp8, moved["fp8"]),
    ]
    rows = []
    for name, fn, nbytes in copies:
        t = _kernel_us(partial(fn, x))
        rows.append(dict(name=name, tokens=tokens, hidden=hidden, time_us=t, GBps=nbytes / t / 1e3))
    return rows


def _kernel_us(fn) -> float:
    """The device time of ``fn``'s kernels in µs, the largest over ranks of
    triton.testing.do_bench's medians. do_bench clears L2 before each call, which also keeps the
    GPU busy while the host issues the call: per-call events alone (median_us) count the host's
    issuing time whenever the GPU has caught up, which for a kernel of tens of µs is much of it."""
    from triton.testing import do_bench

    return _largest_over_ranks([do_bench(fn, return_mode="median") * 1e3])[0]


def _bench_rank(rank: int, world: int, opts: dict) -> dict:
    import hybrid_ep_triton as hep
    from hybrid_ep_triton import reference

    warmup, iters = opts["warmup"], opts["iters"]
    result = {"rows": [], "baselines": [], "errors": [], "copies": []}
    result["ceiling_GBps"] = _ceiling_gbps(rank, world, warmup, iters)
    for name in opts["shapes"]:
        shape = SHAPES[name]
        sets = [inputs(shape, rank, s) for s in range(_ROTATE)]
        rows_all, rows_remote = _row_counts(sets[0][1], world, shape.experts)
        row_bytes = shape.hidden * 2
        common = dict(
            dtype="bf16",
            shape=shape.name,
            tokens=shape.tokens,
            hidden=shape.hidden,
            topk=shape.topk,
            experts=shape.experts,
            ranks=world,
        )
        main_shape = name in ("S1", "S2")
        runs = [
            (sms, expand, None)
            for expand in ((True, False) if main_shape else (True,))
            for sms in (opts["sms"] if main_shape else opts["spot_sms"])
        ]
        if main_shape and opts["ranks_per_node"]:
            runs += [
                (sms, expand, opts["ranks_per_node"])
                for expand in (True, False)
                for sms in opts["spot_sms"]
            ]
        for sms, expand, per_node in runs:
            buf = hep.Buffer(
                None,
                hidden_size=shape.hidden,
                max_tokens_per_rank=shape.tokens,
                num_experts=shape.experts,
                num_sms=sms,
                timeout_s=30,
                expand=expand,
                ranks_per_node=per_node or world,
            )
            error, net_rows = _check(buf, reference, shape, *sets[0])
            what = f"num_sms={sms}, expand={expand}, ranks_per_node={per_node or world}"
            # Block-scaled rows on the single-node path of the main shapes, beside bf16 ones.
            kinds = [("bf16", row_bytes)]
            if main_shape and per_node is None:
                for fmt in opts["formats"]:
                    size = SCALED_ROW_BYTES[fmt]
                    error = error or _check_scaled(buf, reference, shape, fmt, *sets[0])
                    kinds += [(fmt, size(shape.hidden)), (f"{fmt}-quantize", size(shape.hidden))]
            if error:
                result["errors"].append(f"{what}: {error}")
                kinds = []
            for kind, nbytes in kinds:
                timed = _time_buffer(buf, sets, warmup, iters, rows=kind)
                for (op, mode), (t, host) in timed.items():
                    if rank == 0:
                        print(f"{name} {kind} {op} {mode} {what}: {t:.1f} us", flush=True)
                    result["rows"].append(
                        dict(
                            common,
                            dtype=kind,
                            op=op,
                            mode=mode,
                            expand=expand,
                            num_sms=sms,
                            time_us=t,
                            host_us=host,
                            ranks_per_node=per_node or world,
                            net_rows=net_rows,
                            algo_GBps=rows_all * nbytes / t / 1e3,
                            nvlink_GBps=rows_remote * nbytes / t / 1e3,
                            net_GBps=net_rows * nbytes / t / 1e3,
                        )
                    )
            if main_shape and per_node is None and not result["copies"] and not error:
                result["copies"] = _time_copies(reference, sets[0][0])
            buf.destroy()

        def ref_dispatch(x, i, w, experts=shape.experts):
            return reference.dispatch(None, x, i, w, num_experts=experts)

        ref = [ref_dispatch(*s) for s in sets]
        ref_comb = [(torch.randn_like(rx), h, rw) for rx, rw, _, h in ref]
        t_disp, _ = median_us(ref_dispatch, sets, warmup, iters)
        t_comb, _ = median_us(
            lambda y, h, w: reference.combine(None, y, h, weights=w), ref_comb, warmup, iters
        )
        for op, t in (("dispatch", t_disp), ("combine", t_comb)):
            result["baselines"].append(
                dict(
                    common,
                    name="nccl_alltoall",
                    op=op,
                    time_us=t,
                    algo_GBps=rows_all * row_bytes / t / 1e3,
                )
            )
    return result


def _write(result: dict, out_dir: str) -> str:
    lines = [
        f"# hybrid_ep_triton benchmark: {result['machine']}, EP{result['ranks']}",
        "",
        f"date {result['date']}, commit {result['commit']}, ceiling (copy engine, per "
        f"direction, all GPUs sending) {result['ceiling_GBps']:.0f} GB/s",
        "",
        "rows: expert = expert-major (expand=True, the default); token = one row per token "
        "(expand=False, DeepEP's output)",
        "",
        "nodes: N x R, the group split into N nodes of R ranks (transfers between nodes are "
        "NVSHMEM puts); net rows: token rows one rank's dispatch put over the network",
        "",
        "dtype: bf16 rows; fp8, mxfp8, nvfp4: the format's (values, scales) pair passed; "
        "<format>-quantize: bf16 rows passed with quantize=<format> (fp8 and mxfp8 move "
        "hidden + hidden / 32 bytes a row, nvfp4 hidden / 2 + hidden / 16)",
        "",
        "| shape | nodes | rows | dtype | op | mode | SMs | time µs | host µs | algo GB/s | "
        "between GPUs GB/s | net rows | net GB/s |",
        "|---|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        rows = "expert" if r["expand"] else "token"
        nodes = f"{r['ranks'] // r['ranks_per_node']}x{r['ranks_per_node']}"
        lines.append(
            f"| {r['shape']} | {nodes} | {rows} | {r['dtype']} | {r['op']} | {r['mode']} | "
            f"{r['num_sms']} | {r['time_us']:.1f} | {r['host_us']:.0f} | {r['algo_GBps']:.0f} | "
            f"{r['nvlink_GBps']:.0f} | {r['net_rows']} | {r['net_GBps']:.0f} |"
        )
    if result["copies"]:
        lines += [
            "",
            "copies: kernel time, triton.testing.do_bench's median (L2 cleared before each call)",
            "",
            "| copy of the first shape's rows | time µs | GB/s read + written |",
            "|---|---:|---:|",
        ]
        for c in result["copies"]:
            lines.append(
                f"| {c['name']} ({c['tokens']}x{c['hidden']}) | {c['time_us']:.1f} | "
                f"{c['GBps']:.0f} |"
            )
    lines += ["", "| shape | baseline | op | time µs | algo GB/s |", "|---|---|---|---:|---:|"]
    for b in result["baselines"]:
        cells = (b["shape"], b["name"], b["op"], f"{b['time_us']:.1f}", f"{b['algo_GBps']:.0f}")
        lines.append("| " + " | ".join(cells) + " |")
    return write_report(out_dir, f"ep{result['ranks']}", lines, result, _plot)


def write_report(out_dir: str, name: str, lines: list[str], result: dict, plot) -> str:
    """Write a benchmark's report into ``out_dir`` as STEM.json (``result``), STEM.md (the
    Markdown ``lines``, then ``result``'s errors) and STEM.png (``plot(result, path)``), STEM
    being DATE-MACHINE-``name`` from ``result``; returns STEM (with ``out_dir``)."""
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, f"{result['date']}-{result['machine_slug']}-{name}")
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    if result["errors"]:
        lines += ["", "Errors:", *[f"- {e}" for e in result["errors"]]]
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    plot(result, stem + ".png")
    return stem


def _plot(result: dict, path: str) -> None:
    """One panel per shape that ran (algo GB/s of bf16 rows over num_sms, the ceiling and the
    NCCL baseline), and where formats ran a panel of their graph-mode dispatch times."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = [s for s in ("S1", "S2") if any(r["shape"] == s for r in result["rows"])]
    formats = sorted({r["dtype"] for r in result["rows"]} - {"bf16"})
    panels = max(len(shapes) + bool(formats), 1)
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4), squeeze=False)
    axes = list(axes[0])
    for ax, shape in zip(axes[: len(shapes)], shapes, strict=True):
        _plot_shape(ax, result, shape)
    if formats:
        _plot_formats(axes[len(shapes)], result, ["bf16", *formats])
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _plot_shape(ax, result: dict, shape: str) -> None:
    for op, mode, expand, style in _PLOTTED:
        pts = sorted(
            (r["num_sms"], r["algo_GBps"])
            for r in result["rows"]
            if (r["shape"], r["op"], r["mode"], r["expand"]) == (shape, op, mode, expand)
            and r["ranks_per_node"] == result["ranks"]
            and r["dtype"] == "bf16"
        )
        label = f"{op} ({mode}{'' if expand else ', token rows'})"
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label)
    ax.axhline(result["ceiling_GBps"], color="k", ls=":", label="copy-engine ceiling")
    for b in result["baselines"]:
        if b["shape"] == shape:
            ax.axhline(
                b["algo_GBps"],
                color="gray" if b["op"] == "dispatch" else "silver",
                ls="-.",
                label=f"NCCL reference {b['op']}",
            )
    ax.set_title(f"{shape}, EP{result['ranks']}, {result['machine']}")
    ax.set_xlabel("num_sms (the senders' SM budget)")
    ax.set_ylabel("algo GB/s")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def _plot_formats(ax, result: dict, kinds: list[str]) -> None:
    """Graph-mode dispatch µs of each row format, both layouts, at the first shape and the
    fewest SMs that ran it (one node)."""
    rows = [
        r
        for r in result["rows"]
        if r["op"] == "dispatch" and r["mode"] == "graph" and r["ranks_per_node"] == result["ranks"]
    ]
    if not rows:  # every configuration failed its check: the report lists why
        return
    shape, sms = rows[0]["shape"], min(r["num_sms"] for r in rows)
    width = 0.4
    for offset, expand in ((-width / 2, True), (width / 2, False)):
        times = {
            r["dtype"]: r["time_us"]
            for r in rows
            if (r["shape"], r["num_sms"], r["expand"]) == (shape, sms, expand)
        }
        xs = [i + offset for i, kind in enumerate(kinds) if kind in times]
        ax.bar(
            xs,
            [times[k] for k in kinds if k in times],
            width,
            label="expert rows" if expand else "token rows",
        )
    ax.set_xticks(range(len(kinds)), kinds, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("dispatch µs (graph replay)")
    ax.set_title(f"{shape}, row formats, {sms} SMs, EP{result['ranks']}")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7)


def package_dir() -> str:
    """The directory this package is imported from (src/hybrid_ep_triton in a checkout)."""
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def commit() -> str:
    """The code a result measured: ``HEP_COMMIT`` when set; else the short git commit of the
    checkout the package is imported from (its ``__init__.py`` tracked there: a venv inside some
    other repository does not count), whatever the working folder; else the installed
    distribution's version; else "unknown"."""
    if os.environ.get("HEP_COMMIT"):
        return os.environ["HEP_COMMIT"]
    here = package_dir()
    try:
        git = ["git", "-C", here]
        subprocess.run(
            [*git, "ls-files", "--error-unmatch", "__init__.py"], capture_output=True, check=True
        )
        return subprocess.run(
            [*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    try:
        return importlib.metadata.version("hybrid-ep-triton")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def run(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print("hybrid-ep bench needs CUDA GPUs")
        return 2
    gpus = torch.cuda.device_count()
    world = args.ranks or gpus
    if world > gpus:
        print(
            f"hybrid-ep bench times one rank per GPU: {world} ranks would share {gpus} GPU(s), "
            "and times under MPS are not speeds"
        )
        return 2
    formats = [f for f in args.formats.split(",") if f]
    unknown = set(formats) - set(SCALED_ROW_BYTES)
    if unknown:
        print(
            f"hybrid-ep bench: unknown --formats {sorted(unknown)}; known: "
            f"{', '.join(SCALED_ROW_BYTES)}"
        )
        return 2
    opts = dict(
        sms=[int(s) for s in args.sms.split(",")],
        spot_sms=[int(s) for s in args.spot_sms.split(",")],
        shapes=args.shapes.split(","),
        formats=formats,
        ranks_per_node=args.ranks_per_node,
        warmup=args.warmup,
        iters=args.iters,
    )
    per_rank = run_ranks(_bench_rank, world, opts, device="cuda", timeout_s=args.timeout)
    name = torch.cuda.get_device_name(0)
    result = dict(
        machine=f"{world}x {name}",
        machine_slug=f"{world}x{name.replace('NVIDIA ', '').replace(' ', '')}",
        date=datetime.date.today().isoformat(),
        commit=commit(),
        ranks=world,
        ceiling_GBps=min(r["ceiling_GBps"] for r in per_rank),
        rows=per_rank[0]["rows"],
        baselines=per_rank[0]["baselines"],
        copies=per_rank[0]["copies"],
        errors=sorted({e for r in per_rank for e in r["errors"]}),
    )
    stem = _write(result, args.out)
    with open(stem + ".md") as f:
        print(f.read())
    return 1 if result["errors"] else 0
