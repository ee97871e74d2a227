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
the median over ``--iters`` replays after ``--warmup``, input sets rotated. Each call is timed
twice: alone in a graph (the graph's launch included: an empty one takes about as long as the
receive half of a world-1 call, which has nothing to do), and as one of ``_CALLS`` calls of a
graph, each on the next input set (the time of the graph over ``_CALLS``), as a call runs in a
decode step's graph among the model's kernels. The memory table
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
_CALLS = 8  # calls of a graph in the per-call timings


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


def _timed(make_call, sets, warmup: int, iters: int) -> tuple[float, float]:
    """(median µs of a graph of one call, median µs a call in graphs of _CALLS calls), where
    ``make_call(*set)`` gives the call on an input set; each call of a graph of _CALLS on the
    next set."""
    single = [[_captured(make_call(*inputs))] for inputs in sets]
    batched = []
    for start in range(len(sets)):
        calls = [make_call(*sets[(start + c) % len(sets)]) for c in range(_CALLS)]
        batched.append([_captured(lambda calls=calls: [call() for call in calls])])
    return (_replay_us(single, warmup, iters)[0],
            _replay_us(batched, warmup, iters)[0] / _CALLS)  # fmt: skip


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

    # Checks, then the timings.
    variants = {"bf16": dict(use_fp8=False), "fp8": dict(use_fp8=True),
                "fp8 ue8m0": dict(use_fp8=True, round_scale=True, use_ue8m0=True)}  # fmt: skip
    for name, kw in variants.items():
        for x, i, _ in sets:
            recv, count, handle, _, _ = dispatch(x, i, **kw)
            problem = _check_dispatch(x, i, recv, count, handle, name != "bf16", "ue8m0" in name)
            if problem:
                errors.append(f"dispatch {name}: {problem}")
                break
        times = _timed(lambda x, i, w, kw=kw: partial(dispatch, x, i, **kw), sets, warmup, iters)
        timings.append(("dispatch", name, "one launch", *times))
    # Hooks: the send and the receive halves, each its own graph.
    halves = [_capture_halves(lambda x=x, i=i: dispatch(x, i, use_fp8=False,
                                                        return_recv_hook=True))
              for x, i, _ in sets]  # fmt: skip
    send_us, receive_us = _replay_us(halves, warmup, iters)
    timings += [("dispatch", "bf16", "send half", send_us, None),
                ("dispatch", "bf16", "receive half", receive_us, None)]  # fmt: skip
    # Combine of each set's rows, doubled by the "experts".
    combine_sets, combine_halves = [], []
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
        combine_sets.append((y, i, w, handle))
        call = partial(ll.low_latency_combine, y, i, w, handle, return_recv_hook=True)
        combine_halves.append(_capture_halves(call))
    times = _timed(lambda *c: partial(ll.low_latency_combine, *c), combine_sets, warmup, iters)
    timings.append(("combine", "bf16", "one launch", *times))
    send_us, receive_us = _replay_us(combine_halves, warmup, iters)
    times = _timed(lambda y, i, w, handle: partial(_zero_copy, ll, i, w, handle), combine_sets,
                   warmup, iters)  # fmt: skip
    timings += [("combine", "bf16", "send half", send_us, None),
                ("combine", "bf16", "receive half", receive_us, None),
                ("combine", "bf16", "one launch, zero_copy", *times)]  # fmt: skip
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

    found = []
    for expand in (True, False):
        buf = hep.Buffer(None, hidden_size=HIDDEN, max_tokens_per_rank=tokens,
                         num_experts=EXPERTS, expand=expand)  # fmt: skip
        room = tokens * (TOPK if expand else 1)
        combine_sets = []
        for x, i, w in sets:
            out = buf.dispatch(x, i, w, max_recv_tokens=room)
            weights = out[1] if expand else None
            combine_sets.append((torch.randn_like(out[0]), out[-1], weights))
        rows = "expert-major rows" if expand else "token rows"
        d_times = _timed(lambda x, i, w, buf=buf, room=room: partial(
            buf.dispatch, x, i, w, max_recv_tokens=room), sets, warmup, iters)  # fmt: skip
        c_times = _timed(lambda y, handle, weights, buf=buf: partial(
            buf.combine, y, handle, weights=weights), combine_sets, warmup, iters)  # fmt: skip
        found += [(f"normal mode dispatch, max_recv_tokens, {rows}", *d_times),
                  (f"normal mode combine, {rows}", *c_times)]  # fmt: skip
        buf.destroy()
    return found


def _copies(sets, rows: int, warmup: int, iters: int) -> list:
    """Plain copies of what a bf16 dispatch writes: its rows gathered from x, and a copy of as
    many bytes between two buffers."""

    def gather(x, i, w):
        order = torch.nonzero((i[:, :, None] == torch.arange(EXPERTS, device="cuda")).any(1).T)
        tokens_in_order = order[:, 1].contiguous()  # (expert, token) pairs by expert
        out = torch.empty(len(tokens_in_order), HIDDEN, dtype=x.dtype, device="cuda")
        return partial(torch.index_select, x, 0, tokens_in_order, out=out)

    def copy(x, i, w):
        src = torch.randn(rows, HIDDEN, device="cuda").to(torch.bfloat16)
        return partial(torch.empty_like(src).copy_, src)

    return [("gather of the dispatch's rows (index_select)", *_timed(gather, sets, warmup, iters)),
            ("copy of as many bytes (copy_)", *_timed(copy, sets, warmup, iters))]  # fmt: skip


def _write(result: dict, out_dir: str) -> str:
    from hybrid_ep_triton.tools.bench import write_report

    lines = [
        f"# Low-latency mode, world 1: {result['machine']}",
        "",
        f"date {result['date']}, commit {result['commit']}; {result['tokens']} tokens, hidden "
        f"{HIDDEN}, top-{TOPK} of {EXPERTS} experts: {result['rows']} (token, expert) rows; "
        "CUDA graph replays back to back, medians in µs: alone, a graph of one call (its launch "
        f"included); in a graph of {_CALLS}, a call of a graph of {_CALLS} calls",
        "",
        f"| op | rows | launch | µs alone | µs in a graph of {_CALLS} | GB/s of rows, in a graph "
        f"of {_CALLS} |",
        "|---|---|---|---:|---:|---:|",
    ]
    # Dispatch writes its rows (bf16: 2H bytes; FP8: H + 4H / 128), combine reads them.
    for op, rows, mode, alone, batched in result["timings"]:
        row_bytes = 2 * HIDDEN if rows == "bf16" else HIDDEN + HIDDEN // 32
        gbps = f"{result['rows'] * row_bytes / batched / 1e3:.0f}" if batched else ""
        lines.append(f"| {op} | {rows} | {mode} | {alone:.1f} | {_us(batched)} | {gbps} |")
    lines += ["", f"| baseline | µs alone | µs in a graph of {_CALLS} |", "|---|---:|---:|"]
    lines += [f"| {name} | {alone:.1f} | {_us(batched)} |"
              for name, alone, batched in result["baselines"]]  # fmt: skip
    lines += ["", "Heap bytes a rank (low_latency_tokens = tokens), against DeepEP's "
              "get_low_latency_rdma_size_hint:", "", "| ranks | this library MiB | DeepEP MiB |",
              "|---:|---:|---:|"]  # fmt: skip
    lines += [f"| {m['ranks']} | {m['ours'] / 2**20:.0f} | {m['deepep'] / 2**20:.0f} |"
              for m in result["memory"]]  # fmt: skip
    return write_report(out_dir, f"low-latency-{result['commit']}", lines, result, _plot)


def _us(value: float | None) -> str:
    return "" if value is None else f"{value:.1f}"


def _plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries = [(f"{op} {rows}, {mode}", *times) for op, rows, mode, *times in result["timings"]]
    entries += [tuple(b) for b in result["baselines"]]
    names = [name for name, _, _ in entries]
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(names) + 1.5))
    at = range(len(names))
    ax.barh([y - 0.2 for y in at], [alone for _, alone, _ in entries], height=0.4,
            color="tab:gray", label="alone in a graph")  # fmt: skip
    ax.barh([y + 0.2 for y in at], [batched or 0 for _, _, batched in entries], height=0.4,
            color="tab:blue", label=f"a call in a graph of {_CALLS}")  # fmt: skip
    ax.set_yticks(range(len(names)), names, fontsize=7)
    ax.invert_yaxis()
    ax.axvline(10, color="k", ls=":", label="10 µs")
    ax.set_xlabel("µs (CUDA graph replay, median)")
    ax.set_title(f"Low-latency mode, world 1, {result['tokens']} tokens: {result['machine']}",
                 fontsize=9)  # fmt: skip
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def arguments(description: str) -> argparse.ArgumentParser:
    """The options every low-latency benchmark takes."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", default="bench/results")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--iters", type=int, default=200)
    return p


def run(rank_fn, args: argparse.Namespace, write, **opts) -> int:
    """Run ``rank_fn`` on one GPU rank, then ``write`` its result (with the machine, date,
    commit and tokens) into args.out and print it; 1 if the result has errors."""
    from hybrid_ep_triton.tools.bench import commit
    from hybrid_ep_triton.tools.launcher import run_ranks

    opts.update(tokens=args.tokens, warmup=args.warmup, iters=args.iters)
    (found,) = run_ranks(rank_fn, 1, opts, device="cuda", timeout_s=1800)
    name = torch.cuda.get_device_name(0)
    result = dict(
        machine=f"1x {name}", machine_slug=f"1x{name.replace('NVIDIA ', '').replace(' ', '')}",
        date=datetime.date.today().isoformat(), commit=commit(), tokens=args.tokens, **found,
    )  # fmt: skip
    stem = write(result, args.out)
    with open(stem + ".md") as f:
        print(f.read())
    return 1 if result["errors"] else 0


def main() -> int:
    return run(_rank, arguments(__doc__.split("\n\n")[0]).parse_args(), _write)


if __name__ == "__main__":
    raise SystemExit(main())
