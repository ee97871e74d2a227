"""Latency of the low-latency mode (decode) on one GPU, world 1, in CUDA graphs.

One run, on one rank (an NCCL group of one, so every row stays on the GPU: this measures the
kernels' own cost, the floor under any number of ranks):
- low_latency_dispatch (bf16 rows, FP8, FP8 with UE8M0 scales) and low_latency_combine (bf16,
  and zero_copy), each one launch; and with return_recv_hook the send and the receive halves;
- the normal mode's small-batch calls on the same inputs: dispatch with max_recv_tokens (no
  host synchronisation) and combine, in graphs, expert-major rows and token rows;
- plain copies of the same bytes: the dispatch's rows gathered from x (index_select, which
  writes what dispatch writes), and a device-to-device copy of as many bytes.
Each call is first checked against plain torch (bf16 rows bit for bit, FP8 values and scales
bit for bit against ``reference.quantize_fp8_low_latency``, combine within bf16 rounding).
Times: every graph is replayed in a queue that a sleeping kernel holds back first, so that the
GPU runs the replays back to back whatever the host's pace, with a CUDA event between each two;
the median over ``--iters`` replays after ``--warmup``, input sets rotated. The memory table
compares ``Buffer.low_latency_bytes`` with DeepEP's ``get_low_latency_rdma_size_hint`` formula.

Usage (on a GPU machine): python bench/low_latency.py [--out DIR] [--tokens 128] [--iters 200]
Writes <out>/<date>-<machine>-low-latency-<commit>.{json,md,png}.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
from functools import partial

import torch

HIDDEN, EXPERTS, TOPK = 7168, 256, 8
_SETS = 4  # input sets rotated through
_SLEEP_CYCLES = 20_000_000  # about 10 ms: the host queues a batch of replays meanwhile
_BATCH = 50  # replays queued behind one sleep


def _inputs(tokens: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, device="cuda", generator=g).to(torch.bfloat16)
    scores = torch.rand(tokens, EXPERTS, device="cuda", generator=g)
    topk_idx = scores.topk(TOPK, dim=1).indices
    weights = torch.rand(tokens, TOPK, device="cuda", generator=g)
    return x, topk_idx, weights


class _Graph:
    """A captured CUDA graph with what its replays read: torch.cuda.graph frees the cached
    blocks nothing references at each capture, so a graph's inputs must stay referenced."""

    def __init__(self, graph, *kept):
        self.graph, self.kept = graph, kept

    def replay(self) -> None:
        self.graph.replay()


def _captured(fn) -> _Graph:
    from hybrid_ep_triton.tools.bench import capture

    return _Graph(capture(fn)[0], fn)


def _replay_us(cycles: list[list], warmup: int, iters: int) -> list[float]:
    """Median µs of each step of a cycle of graph replays: ``cycles[s]`` is input set s's
    graphs, one per step, replayed in order; round i replays set i % len(cycles)."""
    steps = len(cycles[0])
    for i in range(warmup):
        for graph in cycles[i % len(cycles)]:
            graph.replay()
    torch.cuda.synchronize()
    marks = [[torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)] for _ in range(iters)]
    for i in range(iters):
        if i % _BATCH == 0:
            torch.cuda._sleep(_SLEEP_CYCLES)
        marks[i][0].record()
        for step, graph in enumerate(cycles[i % len(cycles)]):
            graph.replay()
            marks[i][step + 1].record()
    torch.cuda.synchronize()
    return [statistics.median(m[s].elapsed_time(m[s + 1]) * 1e3 for m in marks)
            for s in range(steps)]  # fmt: skip


def _expected_rows(x, topk_idx):
    """Per global expert, the token indices that name it, in order (world 1)."""
    return [torch.nonzero((topk_idx == e).any(dim=1)).flatten() for e in range(EXPERTS)]


def _check_dispatch(x, topk_idx, recv, count, handle, fp8: bool, ue8m0: bool) -> str | None:
    from hybrid_ep_triton import reference

    expected = _expected_rows(x, topk_idx)
    if count.tolist() != [len(t) for t in expected]:
        return "recv_count differs"
    values, scales = recv if fp8 else (recv, None)
    want_values, want_scales = (
        reference.quantize_fp8_low_latency(x, round_scale=ue8m0) if fp8 else (x, None)
    )
    for e, tokens in enumerate(expected):
        n = len(tokens)
        if not torch.equal(handle.src_info[e, :n], tokens.int()):
            return f"src_info of expert {e} differs"
        if not torch.equal(values[e, :n].view(torch.uint8), want_values[tokens].view(torch.uint8)):
            return f"rows of expert {e} differ"
        if fp8:
            got = scales[e, :n]
            if ue8m0:  # the exponent bytes, four groups to a word (byte i: group 4p + i)
                shifts = torch.arange(0, 32, 8, device=got.device)
                got = ((got[:, :, None] >> shifts) & 0xFF).flatten(1)[:, : want_scales.shape[1]]
                want = want_scales[tokens].view(torch.int32) >> 23
            else:
                want = want_scales[tokens]
            if not torch.equal(got, want):
                return f"scales of expert {e} differ"
    return None


def _check_combine(x, topk_idx, weights, out) -> str | None:
    """out against sum_k w * 2x (the experts here double their rows: exact in bf16)."""
    want = (weights.sum(dim=1, keepdim=True) * (2 * x.float())).to(torch.bfloat16).float()
    err = ((out.float() - want).norm() / want.norm()).item()
    return None if err < 1e-2 else f"combine relative error {err:.2e}"


def _rank(rank: int, world: int, opts: dict) -> dict:
    import hybrid_ep_triton as hep
    from hybrid_ep_triton.runtime.planner import deepep_low_latency_bytes

    tokens, warmup, iters = opts["tokens"], opts["warmup"], opts["iters"]
    sets = [_inputs(tokens, seed) for seed in range(_SETS)]
    rows = sum(int((i >= 0).sum()) for _, i, _ in sets[:1])  # (token, expert) rows of a set
    ll = hep.Buffer(None, hidden_size=HIDDEN, max_tokens_per_rank=tokens, num_experts=EXPERTS,
                    low_latency_tokens=tokens)  # fmt: skip
    errors, timings = [], []

    def dispatch(x, i, **kw):
        return ll.low_latency_dispatch(x, i, tokens, EXPERTS, **kw)

    # Checks, then a graph per input set and call.
    variants = {"bf16": dict(use_fp8=False), "fp8": dict(use_fp8=True),
                "fp8 ue8m0": dict(use_fp8=True, round_scale=True, use_ue8m0=True)}  # fmt: skip
    for name, kw in variants.items():
        for x, i, _ in sets:
            recv, count, handle, _, _ = dispatch(x, i, **kw)
            problem = _check_dispatch(x, i, recv, count, handle, name != "bf16", "ue8m0" in name)
            if problem:
                errors.append(f"dispatch {name}: {problem}")
                break
        graphs = [[_captured(partial(dispatch, x, i, **kw))] for x, i, _ in sets]
        timings.append(("dispatch", name, "one launch", _replay_us(graphs, warmup, iters)[0]))
    # Hooks: the send and the receive halves, each its own graph.
    halves = [_capture_halves(lambda x=x, i=i: dispatch(x, i, use_fp8=False,
                                                        return_recv_hook=True))
              for x, i, _ in sets]  # fmt: skip
    send_us, receive_us = _replay_us(halves, warmup, iters)
    timings += [("dispatch", "bf16", "send half", send_us),
                ("dispatch", "bf16", "receive half", receive_us)]  # fmt: skip
    # Combine of each set's rows, doubled by the "experts".
    combines, combine_halves, zero_copies = [], [], []
    for x, i, w in sets:
        recv, _, handle, _, _ = dispatch(x, i, use_fp8=False)
        y = recv * 2
        for zero_copy in (False, True):
            if zero_copy:
                ll.get_next_low_latency_combine_buffer(handle).copy_(y)
                combined = _zero_copy(ll, i, w, handle)[0]
            else:
                combined = ll.low_latency_combine(y, i, w, handle)[0]
            problem = _check_combine(x, i, w, combined)
            if problem:
                errors.append(f"combine (zero_copy={zero_copy}): {problem}")
        call = partial(ll.low_latency_combine, y, i, w, handle)
        combines.append([_captured(call)])
        combine_halves.append(_capture_halves(partial(call, return_recv_hook=True)))
        zero_copies.append([_captured(partial(_zero_copy, ll, i, w, handle))])
    timings.append(("combine", "bf16", "one launch", _replay_us(combines, warmup, iters)[0]))
    send_us, receive_us = _replay_us(combine_halves, warmup, iters)
    timings += [("combine", "bf16", "send half", send_us),
                ("combine", "bf16", "receive half", receive_us),
                ("combine", "bf16", "one launch, zero_copy",
                 _replay_us(zero_copies, warmup, iters)[0])]  # fmt: skip
    ll.destroy()

    baselines = _normal_mode(sets, tokens, warmup, iters, errors) + _copies(
        sets, rows, warmup, iters
    )
    memory = [
        dict(ranks=w, ours=hep.Buffer.low_latency_bytes(tokens, HIDDEN, w, EXPERTS),
             deepep=deepep_low_latency_bytes(tokens, HIDDEN, w, EXPERTS))
        for w in (1, 2, 8, 16, 32)
    ]  # fmt: skip
    return dict(timings=timings, baselines=baselines, memory=memory, errors=errors, rows=rows)


def _capture_halves(call) -> list:
    """Graphs of a call's send half and of its receive hook (``call`` returns the hook last),
    after one eager call and hook."""
    call()[-1]()
    send, receive = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(send):
        hook = call()[-1]
    with torch.cuda.graph(receive):
        hook()
    return [_Graph(send, call), _Graph(receive, hook)]


def _zero_copy(ll, topk_idx, weights, handle):
    """A zero-copy combine of what the next combine buffer holds (in a replay, whatever the
    buffer of its call holds: the experts would have written there)."""
    buffer = ll.get_next_low_latency_combine_buffer(handle)
    return ll.low_latency_combine(buffer, topk_idx, weights, handle, zero_copy=True)


def _normal_mode(sets, tokens: int, warmup: int, iters: int, errors: list) -> list:
    """The normal mode's small-batch graph calls on the same inputs (max_recv_tokens: every
    row), both row layouts."""
    import hybrid_ep_triton as hep
    from hybrid_ep_triton.tools.bench import capture

    found = []
    for expand in (True, False):
        buf = hep.Buffer(None, hidden_size=HIDDEN, max_tokens_per_rank=tokens,
                         num_experts=EXPERTS, expand=expand)  # fmt: skip
        room = tokens * (TOPK if expand else 1)
        graphs = []
        for x, i, w in sets:
            d_graph, out = capture(partial(buf.dispatch, x, i, w, max_recv_tokens=room))
            d_graph.replay()
            weights = out[1] if expand else None
            y = torch.randn_like(out[0])
            graphs.append(
                [_Graph(d_graph, out), _captured(partial(buf.combine, y, out[-1], weights=weights))]
            )
        d_us, c_us = _replay_us(graphs, warmup, iters)
        rows = "expert-major rows" if expand else "token rows"
        found += [(f"normal mode dispatch, max_recv_tokens, {rows}", d_us),
                  (f"normal mode combine, {rows}", c_us)]  # fmt: skip
        buf.destroy()
    return found


def _copies(sets, rows: int, warmup: int, iters: int) -> list:
    """Plain copies of what a bf16 dispatch writes: its rows gathered from x, and a copy of as
    many bytes between two buffers."""

    gathers, copies = [], []
    for x, i, _ in sets:
        order = torch.nonzero((i[:, :, None] == torch.arange(EXPERTS, device="cuda")).any(1).T)
        tokens_in_order = order[:, 1].contiguous()  # (expert, token) pairs by expert
        out = torch.empty(len(tokens_in_order), HIDDEN, dtype=x.dtype, device="cuda")
        gathers.append([_captured(partial(torch.index_select, x, 0, tokens_in_order, out=out))])
        src = torch.randn(rows, HIDDEN, device="cuda").to(torch.bfloat16)
        dst = torch.empty_like(src)
        copies.append([_captured(partial(dst.copy_, src))])
    return [("gather of the dispatch's rows (index_select)", _replay_us(gathers, warmup, iters)[0]),
            ("copy of as many bytes (copy_)", _replay_us(copies, warmup, iters)[0])]  # fmt: skip


def _write(result: dict, out_dir: str) -> str:
    from hybrid_ep_triton.tools.bench import write_report

    lines = [
        f"# Low-latency mode, world 1: {result['machine']}",
        "",
        f"date {result['date']}, commit {result['commit']}; {result['tokens']} tokens, hidden "
        f"{HIDDEN}, top-{TOPK} of {EXPERTS} experts: {result['rows']} (token, expert) rows; "
        "CUDA graph replays back to back, median µs",
        "",
        "| op | rows | launch | µs | GB/s of rows |",
        "|---|---|---|---:|---:|",
    ]
    # Dispatch writes its rows (bf16: 2H bytes; FP8: H + 4H / 128), combine reads them.
    for op, rows, mode, us in result["timings"]:
        row_bytes = 2 * HIDDEN if rows == "bf16" else HIDDEN + HIDDEN // 32
        lines.append(f"| {op} | {rows} | {mode} | {us:.1f} | "
                     f"{result['rows'] * row_bytes / us / 1e3:.0f} |")  # fmt: skip
    lines += ["", "| baseline | µs |", "|---|---:|"]
    lines += [f"| {name} | {us:.1f} |" for name, us in result["baselines"]]
    lines += ["", "Heap bytes a rank (low_latency_tokens = tokens), against DeepEP's "
              "get_low_latency_rdma_size_hint:", "", "| ranks | this library MiB | DeepEP MiB |",
              "|---:|---:|---:|"]  # fmt: skip
    lines += [f"| {m['ranks']} | {m['ours'] / 2**20:.0f} | {m['deepep'] / 2**20:.0f} |"
              for m in result["memory"]]  # fmt: skip
    return write_report(out_dir, f"low-latency-{result['commit']}", lines, result, _plot)


def _plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [f"{op} {rows}, {mode}" for op, rows, mode, _ in result["timings"]]
    names += [name for name, _ in result["baselines"]]
    times = [t[3] for t in result["timings"]] + [us for _, us in result["baselines"]]
    colors = ["tab:blue"] * len(result["timings"]) + ["tab:gray"] * len(result["baselines"])
    fig, ax = plt.subplots(figsize=(9, 0.35 * len(names) + 1.5))
    ax.barh(range(len(names)), times, color=colors)
    ax.set_yticks(range(len(names)), names, fontsize=7)
    ax.invert_yaxis()
    ax.axvline(10, color="k", ls=":", label="10 µs")
    ax.set_xlabel("µs (CUDA graph replay, median)")
    ax.set_title(f"Low-latency mode, world 1, {result['tokens']} tokens: {result['machine']}",
                 fontsize=9)  # fmt: skip
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    from hybrid_ep_triton.tools.bench import commit
    from hybrid_ep_triton.tools.launcher import run_ranks

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench/results")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--iters", type=int, default=200)
    args = p.parse_args()
    opts = dict(tokens=args.tokens, warmup=args.warmup, iters=args.iters)
    (found,) = run_ranks(_rank, 1, opts, device="cuda", timeout_s=1200)
    name = torch.cuda.get_device_name(0)
    result = dict(
        machine=f"1x {name}", machine_slug=f"1x{name.replace('NVIDIA ', '').replace(' ', '')}",
        date=datetime.date.today().isoformat(), commit=commit(), tokens=args.tokens, **found,
    )  # fmt: skip
    stem = _write(result, args.out)
    with open(stem + ".md") as f:
        print(f.read())
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
