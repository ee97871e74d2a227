"""The DeepEP drop-in (``hybrid_ep_triton.deep_ep.Buffer``) beside the native Buffer calls it
maps to, at world 1 on one GPU (or one CPU rank, Triton's interpreter, for a smoke test).

Per shape (S1: 4096 tokens, hidden 7168, top-8 of 256 experts, bf16; S2: 128 tokens, the same
model; tiny: 16 tokens, hidden 64, top-2 of 8, the CPU default), in one rank process, a drop-in
Buffer and a native ``Buffer(expand=False)`` of the same sizes (a pair made for each shape, so
that each is sized for its tokens as a user's would be), the calls as pairs:

- dispatch: drop-in ``dispatch(x, topk_idx=, topk_weights=, num_tokens_per_rank=,
  is_token_in_rank=, num_tokens_per_expert=)`` (get_dispatch_layout's outputs, made before)
  against native ``dispatch(x, topk_idx, topk_weights)``;
- layout+dispatch: drop-in ``get_dispatch_layout(topk_idx, E)`` then that dispatch, against
  the same native dispatch (what a DeepEP user's step pays);
- combine: drop-in ``combine(y, handle, topk_weights=recv_topk_weights)`` against native
  ``combine(y, handle)``, with ``topk_weights=recv_topk_weights`` too where the native combine
  takes it (found with inspect.signature: the call the drop-in maps to then);
- layout: the drop-in's ``get_dispatch_layout`` alone (the native dispatch has its layout
  inside: no native counterpart);
- copy: ``x.clone()``, timed with them: the bytes a dispatch or a combine at world 1 reads and
  writes (T x H bf16), the floor under both sides.

Each call is first checked: at world 1 every token goes to this rank, so the received rows are
x's rows in token order (bit for bit), a combine gives back y's rows (within bf16 rounding),
and combined_topk_weights (the drop-in's, and the native's where it returns them) are
topk_weights.

Modes, every call of a pair interleaved with the other's (call i of each before call i + 1 of
any), input sets rotated (4 sets), medians over ``--iters`` calls after ``--warmup``:
- eager, device µs: CUDA events on the calling stream just before and after each call, the
  calls issued back to back with no synchronisation between them, as a model's loop issues
  them (tools.bench.median_us's method): the stream's span of the call, its kernels plus any
  wait of the GPU for the host to issue them (an exact-mode dispatch waits on the host for its
  row count, so its span holds host time too);
- eager, host µs: the wall-clock time (perf_counter_ns) of the Python call, with the device
  synchronised before each call, outside the timed span: the call's own host work, including
  its own waits on its device work (the row count; the drop-in's counts list), not waits on
  earlier calls' work. On CPU ranks everything is host time: only this one is reported;
- graph: drop-in with num_worst_tokens = W * T, native with max_recv_tokens = W * T (no host
  synchronisation), ``--graph-calls`` calls back to back in one CUDA graph, call c on input
  set c % 4; each replay between two events, replays queued behind a sleeping kernel every 50
  so that the GPU runs them back to back; µs per call = the replay's median / calls. A
  drop-in call that synchronises with the host cannot be captured: it is first run once under
  ``torch.cuda.set_sync_debug_mode("error")``, and where that raises, the row says why and
  nothing is captured (a capture that failed half-way would leave the Buffers waiting for
  launches that never ran). Not on CPU ranks.

The whole set of timings runs ``--rounds`` times (default 2): each round's medians and ratios
are kept, their spread is the noise. Ratio = drop-in / native (above 1: the drop-in is slower).

``--src PATH`` imports hybrid_ep_triton from PATH/src (an older tree, e.g. ``git archive
<commit> src | tar -x -C .ab/old``), so that the same script times the tree before a change in
the same device call; each tree in its own process. ``--compare A.json B.json ...`` writes the
ratios of several such runs side by side (no GPU needed).

Writes <out>/<date>-<machine>-deepep-bench-<commit or label>.{json,md,png}.
Usage: python bench/deep_ep_bench.py [--out DIR] [--shapes S1,S2] [--src PATH] [--label L]
       [--device cpu]; python bench/deep_ep_bench.py --compare RESULT.json ... [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from functools import partial

import torch


@dataclass(frozen=True)
class Shape:
    name: str
    tokens: int
    hidden: int
    topk: int
    experts: int


SHAPES = {
    "S1": Shape("S1", 4096, 7168, 8, 256),
    "S2": Shape("S2", 128, 7168, 8, 256),
    "tiny": Shape("tiny", 16, 64, 2, 8),
}
SIDES = ("drop-in", "native")
# The floor: a plain copy of x (x.clone()), the bytes a dispatch at world 1 reads and writes
# (T x H bf16; a combine's y is as large), timed with the calls.
COPY = "copy"
_SETS = 4  # input sets rotated through
_SLEEP_CYCLES = 20_000_000  # about 10 ms: the host queues a batch of replays meanwhile
_BATCH = 50  # replays queued behind one sleep
# NVSHMEM fixes its heap's size at its first Buffer; a rank here holds several at once (the
# native one, the drop-in's token and metadata Buffers). Address space, not memory.
_HEAP_BYTES = 16 << 30


def _inputs(shape: Shape, seed: int, device: str):
    """x [T, H] bf16, topk_idx [T, K] int64 (distinct experts), topk_weights [T, K] float32."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(shape.tokens, shape.hidden, device=device, generator=g).to(torch.bfloat16)
    scores = torch.rand(shape.tokens, shape.experts, device=device, generator=g)
    topk_idx = scores.topk(shape.topk, dim=1).indices
    weights = torch.rand(shape.tokens, shape.topk, device=device, generator=g)
    return x, topk_idx, weights


class Pair:
    """A drop-in Buffer and the native Buffer(expand=False) of one shape, and their calls."""

    def __init__(self, shape: Shape):
        import torch.distributed as dist

        import hybrid_ep_triton as hep
        from hybrid_ep_triton import deep_ep

        self.shape = shape
        self.worst = dist.get_world_size() * shape.tokens  # W * T rows: never too few
        self.native = hep.Buffer(None, hidden_size=shape.hidden, max_tokens_per_rank=shape.tokens,
                                 num_experts=shape.experts, expand=False)  # fmt: skip
        self.dropin = deep_ep.Buffer(dist.group.WORLD, explicitly_destroy=True)
        self.combine_takes_weights = native_combine_takes_topk_weights()

    def layout(self, x, topk_idx, weights):
        return self.dropin.get_dispatch_layout(topk_idx, self.shape.experts)

    def dropin_dispatch(self, x, topk_idx, weights, worst: bool = False, layout=None):
        """dispatch with get_dispatch_layout's outputs (as DeepEP's users call it): ``layout``,
        or get_dispatch_layout's run first (None)."""
        layout = layout or self.layout(x, topk_idx, weights)
        per_rank, _, per_expert, in_rank, _ = layout
        return self.dropin.dispatch(x, topk_idx=topk_idx, topk_weights=weights,
                                    num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                    num_tokens_per_expert=per_expert,
                                    num_worst_tokens=self.worst if worst else 0)  # fmt: skip

    def native_dispatch(self, x, topk_idx, weights, worst: bool = False):
        return self.native.dispatch(x, topk_idx, weights,
                                    max_recv_tokens=self.worst if worst else None)  # fmt: skip

    def dropin_combine(self, y, handle, recv_weights):
        return self.dropin.combine(y, handle, topk_weights=recv_weights)

    def native_combine(self, y, handle, recv_weights):
        if self.combine_takes_weights:
            return self.native.combine(y, handle, topk_weights=recv_weights)
        return self.native.combine(y, handle)

    def combine_sets(self, side: str, sets, worst: bool = False) -> list[tuple]:
        """(y, handle, recv_topk_weights) of one dispatch of each input set on ``side``."""
        found = []
        for x, topk_idx, weights in sets:
            if side == "drop-in":
                recv_x, _, recv_weights, _, handle, _ = self.dropin_dispatch(
                    x, topk_idx, weights, worst
                )
            else:
                recv_x, _, recv_weights, _, handle = self.native_dispatch(
                    x, topk_idx, weights, worst
                )
            found.append((torch.randn_like(recv_x), handle, recv_weights))
        return found

    def destroy(self) -> None:
        self.dropin.destroy()
        self.native.destroy()


def native_combine_takes_topk_weights() -> bool:
    """Whether the imported tree's native Buffer.combine has ``topk_weights=``."""
    import hybrid_ep_triton as hep

    return "topk_weights" in inspect.signature(hep.Buffer.combine).parameters


# -- checks ------------------------------------------------------------------------------------


def _check_dispatch(what: str, x, outputs) -> str | None:
    """World 1: recv_x's first T rows are x's, in token order, bit for bit."""
    recv_x = outputs[0]
    if not torch.equal(recv_x[: x.shape[0]], x):
        return f"{what}: recv_x differs from x's rows"
    return None


def _check_combine(what: str, y, out, weights=None, combined_weights=None) -> str | None:
    """World 1: each token has one row, so combine gives back y's first T rows (within bf16
    rounding), and combined_topk_weights (where given) are the dispatch's topk_weights."""
    want = y[: out.shape[0]].float()
    err = ((out.float() - want).norm() / want.norm().clamp_min(1e-30)).item()
    if not err < 1e-2:
        return f"{what}: combine relative error {err:.2e}"
    if weights is not None and not torch.allclose(combined_weights, weights):
        return f"{what}: combined_topk_weights differ from topk_weights"
    return None


def _check_pair(pair: Pair, sets) -> list[str]:
    """Each side's eager dispatch and combine on the first input set."""
    x, topk_idx, weights = sets[0]
    errors = []
    for side in SIDES:
        dispatch = pair.dropin_dispatch if side == "drop-in" else pair.native_dispatch
        errors.append(_check_dispatch(f"{side} dispatch", x, dispatch(x, topk_idx, weights)))
        ((y, handle, recv_weights),) = pair.combine_sets(side, sets[:1])
        if side == "drop-in":
            out, combined_weights, _ = pair.dropin_combine(y, handle, recv_weights)
            errors.append(_check_combine("drop-in", y, out, weights, combined_weights))
        else:
            out = pair.native_combine(y, handle, recv_weights)
            if isinstance(out, tuple):  # (out, combined_topk_weights): the native topk_weights=
                errors.append(_check_combine("native", y, out[0], weights, out[1]))
            else:
                errors.append(_check_combine("native", y, out))
    return [f"{pair.shape.name} {e}" for e in errors if e]


# -- eager timings -----------------------------------------------------------------------------


def _eager_calls(pair: Pair, sets) -> dict[tuple[str, str], tuple]:
    """{(op, side): (fn, argument sets)}, the eager calls timed together."""
    laid_out = [(*s, False, pair.layout(*s)) for s in sets]
    return {
        ("dispatch", "drop-in"): (pair.dropin_dispatch, laid_out),
        ("dispatch", "native"): (pair.native_dispatch, sets),
        ("layout+dispatch", "drop-in"): (pair.dropin_dispatch, sets),
        ("combine", "drop-in"): (pair.dropin_combine, pair.combine_sets("drop-in", sets)),
        ("combine", "native"): (pair.native_combine, pair.combine_sets("native", sets)),
        ("layout", "drop-in"): (pair.layout, sets),
        (COPY, COPY): (torch.clone, [(x,) for x, _, _ in sets]),
    }


def _time_eager(calls: dict, warmup: int, iters: int, on_gpu: bool) -> dict:
    """{key: (device µs or None, host µs)} of each call, interleaved (see the module)."""
    keys = list(calls)

    def call(key, i):
        fn, sets = calls[key]
        return fn(*sets[i % len(sets)])

    for i in range(warmup):
        for key in keys:
            call(key, i)
    device = {key: None for key in keys}
    if on_gpu:
        torch.cuda.synchronize()
        stream = torch.cuda.current_stream()
        events = {key: [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                        for _ in range(iters)] for key in keys}  # fmt: skip
        for i in range(iters):
            for key in keys:
                start, end = events[key][i]
                start.record(stream)
                call(key, i)
                end.record(stream)
        torch.cuda.synchronize()
        device = {key: statistics.median(s.elapsed_time(e) * 1e3 for s, e in events[key])
                  for key in keys}  # fmt: skip
    host = {key: [] for key in keys}
    for i in range(iters):
        for key in keys:
            if on_gpu:
                torch.cuda.synchronize()
            t0 = time.perf_counter_ns()
            call(key, i)
            host[key].append((time.perf_counter_ns() - t0) / 1e3)
    if on_gpu:
        torch.cuda.synchronize()
    return {key: (device[key], statistics.median(host[key])) for key in keys}


# -- graphs ------------------------------------------------------------------------------------


class _Graph:
    """A captured CUDA graph with what its replays read and write: torch.cuda.graph frees the
    cached blocks nothing references at each capture, so a graph's inputs must stay referenced."""

    def __init__(self, graph, *kept):
        self.graph, self.kept = graph, kept

    def replay(self) -> None:
        self.graph.replay()


def _synchronises(fn) -> str | None:
    """What makes ``fn()`` synchronise with the host (so that it cannot be captured), or None:
    one eager call under torch.cuda.set_sync_debug_mode("error")."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    except RuntimeError as error:
        return str(error).strip().splitlines()[0]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return None


def _capture(calls: list) -> tuple[_Graph, list]:
    """A graph of ``calls`` back to back (after one eager run on a side stream), and the
    outputs its replays write."""
    from hybrid_ep_triton.tools.bench import capture

    graph, outputs = capture(lambda: [call() for call in calls])
    return _Graph(graph, calls, outputs), outputs


def _graphs(pair: Pair, sets, graph_calls: int, errors: list) -> tuple[dict, dict]:
    """({(op, side): graph}, {(op, side): why it was not captured}) of dispatch and combine,
    each graph ``graph_calls`` calls, call c on input set c % len(sets); each graph replayed
    once and its outputs checked."""
    graphs, refused = {}, {}
    order = [sets[c % len(sets)] for c in range(graph_calls)]
    dispatches = {"drop-in": pair.dropin_dispatch, "native": pair.native_dispatch}
    combines = {"drop-in": pair.dropin_combine, "native": pair.native_combine}
    layouts = [pair.layout(*s) for s in sets]
    laid_out = [partial(pair.dropin_dispatch, *s, worst=True, layout=layouts[c % len(sets)])
                for c, s in enumerate(order)]  # fmt: skip
    for side in SIDES:
        calls = [partial(dispatches[side], *s, worst=True) for s in order]
        combine_args = pair.combine_sets(side, sets, worst=True)
        combine_order = [combine_args[c % len(sets)] for c in range(graph_calls)]
        combine_calls = [partial(combines[side], *args) for args in combine_order]
        ops = [("dispatch", calls), ("combine", combine_calls)]
        if side == "drop-in":  # its dispatch alone, and after get_dispatch_layout
            ops = [("dispatch", laid_out), ("layout+dispatch", calls), ("combine", combine_calls)]
        for op, op_calls in ops:
            why = _synchronises(op_calls[0]) if side == "drop-in" else None
            if why:
                refused[op, side] = f"not capturable: {why}"
                continue
            try:
                graph, outputs = _capture(op_calls)
            except RuntimeError as error:
                refused[op, side] = f"capture failed: {str(error).strip().splitlines()[0]}"
                continue
            graph.replay()
            torch.cuda.synchronize()
            if op != "combine":
                problem = _check_dispatch(f"{side} dispatch graph", order[0][0], outputs[0])
            else:
                out = outputs[0][0] if isinstance(outputs[0], tuple) else outputs[0]
                problem = _check_combine(f"{side} combine graph", combine_order[0][0], out)
            if problem:
                errors.append(f"{pair.shape.name} {problem}")
            graphs[op, side] = graph
    graphs[COPY, COPY] = _capture([partial(torch.clone, x) for x, _, _ in order])[0]
    return graphs, refused


def _time_graphs(graphs: dict, warmup: int, iters: int) -> dict:
    """{key: median µs of a replay}, the graphs replayed in turn each iteration, queued behind a
    sleeping kernel every _BATCH iterations."""
    keys = list(graphs)
    for _ in range(warmup):
        for key in keys:
            graphs[key].replay()
    torch.cuda.synchronize()
    marks = {key: [] for key in keys}
    for i in range(iters):
        if i % _BATCH == 0:
            torch.cuda._sleep(_SLEEP_CYCLES)
        for key in keys:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graphs[key].replay()
            end.record()
            marks[key].append((start, end))
    torch.cuda.synchronize()
    return {key: statistics.median(s.elapsed_time(e) * 1e3 for s, e in marks[key])
            for key in keys}  # fmt: skip


# -- one rank ----------------------------------------------------------------------------------


def _row(shape: Shape, op: str, mode: str, run: int, times: dict, refused: str | None = None):
    """One result row: µs per call of each side and of the copy (None: not run), and the
    drop-in / native ratio."""
    dropin, native = times.get("drop-in"), times.get("native")
    ratio = dropin / native if dropin and native else None
    return dict(shape=shape.name, op=op, mode=mode, round=run, dropin_us=dropin,
                native_us=native, copy_us=times.get(COPY), ratio=ratio, note=refused)  # fmt: skip


# dispatch: each side's dispatch call (the drop-in's on get_dispatch_layout's outputs, made
# before); layout+dispatch: the drop-in's get_dispatch_layout then dispatch, against the same
# native dispatch; layout: get_dispatch_layout alone (no native counterpart).
OPS = ("dispatch", "layout+dispatch", "combine", "layout")


def _key(op: str, side: str) -> tuple[str, str]:
    """The timings' key of ``op`` on ``side``: the native side of layout+dispatch is its
    dispatch."""
    return ("dispatch", side) if (op, side) == ("layout+dispatch", "native") else (op, side)


def _eager_rows(shape: Shape, run: int, eager: dict, on_gpu: bool) -> list[dict]:
    """Rows of _time_eager's times: device µs (GPUs) and host µs, the copy beside each op."""
    rows = []
    for op in OPS:
        sides = {side: eager[_key(op, side)] for side in SIDES if _key(op, side) in eager}
        if op != "layout":
            sides[COPY] = eager[COPY, COPY]
        if on_gpu:
            rows.append(_row(shape, op, "eager", run, {k: t[0] for k, t in sides.items()}))
        rows.append(_row(shape, op, "eager host", run, {k: t[1] for k, t in sides.items()}))
    return rows


def _graph_rows(shape: Shape, run: int, replays: dict, refused: dict, calls: int) -> list[dict]:
    """Rows of _time_graphs's replay times, per call, and why a side was not captured."""
    rows = []
    for op in OPS[:-1]:
        per_call = {side: replays[_key(op, side)] / calls for side in SIDES
                    if _key(op, side) in replays}  # fmt: skip
        per_call[COPY] = replays[COPY, COPY] / calls
        why = refused.get((op, "drop-in")) or refused.get(_key(op, "native"))
        rows.append(_row(shape, op, "graph", run, per_call, why))
    return rows


def _rank(rank: int, world: int, opts: dict) -> dict:
    import hybrid_ep_triton

    on_gpu = torch.cuda.is_available() and opts["device"] == "cuda"
    device = "cuda" if on_gpu else "cpu"
    if world != 1:
        raise ValueError(f"this benchmark runs at world 1, got {world} ranks")
    result = dict(rows=[], errors=[], package=os.path.dirname(hybrid_ep_triton.__file__),
                  combine_takes_topk_weights=native_combine_takes_topk_weights())  # fmt: skip
    warmup, iters, graph_calls = opts["warmup"], opts["iters"], opts["graph_calls"]
    for name in opts["shapes"]:
        shape = SHAPES[name]
        sets = [_inputs(shape, seed, device) for seed in range(_SETS)]
        pair = Pair(shape)
        errors = _check_pair(pair, sets)
        result["errors"] += errors
        if errors:
            pair.destroy()
            continue
        calls = _eager_calls(pair, sets)
        graphs, refused = _graphs(pair, sets, graph_calls, result["errors"]) if on_gpu else ({}, {})
        for run in range(opts["rounds"]):
            eager = _time_eager(calls, warmup, iters, on_gpu)
            replays = _time_graphs(graphs, warmup, iters) if graphs else {}
            rows = _eager_rows(shape, run, eager, on_gpu)
            if on_gpu:
                rows += _graph_rows(shape, run, replays, refused, graph_calls)
            for row in rows:
                print(_line(row), flush=True)
            result["rows"] += rows
        del graphs
        pair.destroy()
    return result


def _line(row: dict) -> str:
    ratio = f"{row['ratio']:.2f}" if row["ratio"] else "-"
    note = f" ({row['note']})" if row["note"] else ""
    return (f"{row['shape']} {row['op']} {row['mode']} round {row['round']}: drop-in "
            f"{_us(row['dropin_us'])} µs, native {_us(row['native_us'])} µs, ratio {ratio}, "
            f"copy {_us(row['copy_us'])} µs{note}")  # fmt: skip


def _us(value) -> str:
    return "-" if value is None else f"{value:.1f}"


# -- report ------------------------------------------------------------------------------------

_MODES = ("eager", "eager host", "graph")


def _summary(result: dict) -> list[dict]:
    """Per (shape, op, mode): the medians over rounds of each side's µs, and the ratios' range."""
    groups = {}
    for row in result["rows"]:
        groups.setdefault((row["shape"], row["op"], row["mode"]), []).append(row)
    found = []
    for (shape, op, mode), rows in groups.items():
        ratios = [r["ratio"] for r in rows if r["ratio"]]
        found.append(dict(
            shape=shape, op=op, mode=mode,
            dropin_us=_median([r["dropin_us"] for r in rows]),
            native_us=_median([r["native_us"] for r in rows]),
            copy_us=_median([r["copy_us"] for r in rows]),
            ratio=_median(ratios), ratio_min=min(ratios, default=None),
            ratio_max=max(ratios, default=None), note=rows[0]["note"],
        ))  # fmt: skip
    return found


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _ratio_cell(s: dict) -> str:
    if s["ratio"] is None:
        return "-"
    return f"{s['ratio']:.2f} ({s['ratio_min']:.2f}-{s['ratio_max']:.2f})"


def _write(result: dict, out_dir: str) -> str:
    lines = [
        f"# DeepEP drop-in against the native Buffer, world 1: {result['machine']}",
        "",
        f"date {result['date']}, commit {result['commit']}; native combine takes topk_weights: "
        f"{result['combine_takes_topk_weights']}; {result['iters']} calls after "
        f"{result['warmup']}, {result['rounds']} rounds, graphs of {result['graph_calls']} "
        "calls. µs per call, medians over the rounds' medians; ratio = drop-in / native, "
        "median (range over the rounds). eager: events around each call, back to back; eager "
        "host: the Python call's wall-clock time, the device synchronised before it; graph: a "
        "replay's time over its calls (drop-in num_worst_tokens = native max_recv_tokens = "
        "W * T). dispatch: the drop-in's dispatch on get_dispatch_layout's outputs, made before; "
        "layout+dispatch: get_dispatch_layout then dispatch; layout: that layout alone. "
        "copy: x.clone() timed with them, the bytes a dispatch or combine at world 1 reads and "
        "writes (the floor).",
        "",
        "| shape | op | mode | drop-in µs | native µs | ratio | copy µs | note |",
        "|---|---|---|---:|---:|---|---:|---|",
    ]
    for s in result["summary"]:
        lines.append(f"| {s['shape']} | {s['op']} | {s['mode']} | {_us(s['dropin_us'])} | "
                     f"{_us(s['native_us'])} | {_ratio_cell(s)} | {_us(s.get('copy_us'))} | "
                     f"{s['note'] or ''} |")  # fmt: skip
    if result["errors"]:
        lines += ["", "Errors:", *[f"- {e}" for e in result["errors"]]]
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(
        out_dir, f"{result['date']}-{result['machine_slug']}-deepep-bench-{result['commit']}"
    )
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    _plot([result], stem + ".png")
    return stem


def _plot(results: list[dict], path: str) -> None:
    """Ratios (drop-in / native) per shape, op and mode: a bar per result, the rounds' range as
    an error bar, a line at 1."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = []
    for result in results:
        for s in result["summary"]:
            key = (s["shape"], s["op"], s["mode"])
            if s["ratio"] is not None and key not in keys:
                keys.append(key)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.6 * len(keys) * len(results) + 2), 4.5))
    width = 0.8 / len(results)
    for n, result in enumerate(results):
        by_key = {(s["shape"], s["op"], s["mode"]): s for s in result["summary"]}
        xs, ys, low, high = [], [], [], []
        for i, key in enumerate(keys):
            s = by_key.get(key)
            if s and s["ratio"] is not None:
                xs.append(i + (n - (len(results) - 1) / 2) * width)
                ys.append(s["ratio"])
                low.append(s["ratio"] - s["ratio_min"])
                high.append(s["ratio_max"] - s["ratio"])
        ax.bar(xs, ys, width, yerr=[low, high], capsize=2, label=result["commit"])
    ax.axhline(1.0, color="k", ls=":")
    ax.set_xticks(range(len(keys)), [" ".join(k) for k in keys], rotation=40, ha="right",
                  fontsize=7)  # fmt: skip
    ax.set_ylabel("drop-in / native (µs per call)")
    ax.set_title(f"DeepEP drop-in against the native Buffer, world 1: {results[0]['machine']}",
                 fontsize=9)  # fmt: skip
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _compare(paths: list[str], out_dir: str) -> str:
    """The ratios of several results (trees) side by side: Markdown and PNG."""
    results = []
    for path in paths:
        with open(path) as f:
            results.append(json.load(f))
    keys = []
    for result in results:
        keys += [(s["shape"], s["op"], s["mode"]) for s in result["summary"]
                 if (s["shape"], s["op"], s["mode"]) not in keys]  # fmt: skip
    labels = [r["commit"] for r in results]
    lines = [
        f"# DeepEP drop-in / native, world 1, by tree: {results[0]['machine']}",
        "",
        "ratio = drop-in µs / native µs per call, median (range over the rounds); then each "
        "side's µs. Trees: " + ", ".join(
            f"{r['commit']} (native combine takes topk_weights: "
            f"{r['combine_takes_topk_weights']}; {r['date']})" for r in results
        ),
        "",
        "| shape | op | mode | " + " | ".join(f"{label} ratio" for label in labels) + " | "
        + " | ".join(f"{label} drop-in / native µs" for label in labels) + " |",
        "|---|---|---|" + "---|" * (2 * len(labels)),
    ]  # fmt: skip
    for key in keys:
        found = [{(s["shape"], s["op"], s["mode"]): s for s in r["summary"]}.get(key)
                 for r in results]  # fmt: skip
        ratios = [_ratio_cell(s) if s else "" for s in found]
        times = [f"{_us(s['dropin_us'])} / {_us(s['native_us'])}" if s else "" for s in found]
        lines.append("| " + " | ".join([*key, *ratios, *times]) + " |")
    errors = [f"{r['commit']}: {e}" for r in results for e in r["errors"]]
    if errors:
        lines += ["", "Errors:", *[f"- {e}" for e in errors]]
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(
        out_dir, f"{results[0]['date']}-{results[0]['machine_slug']}-deepep-bench-ab"
    )
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    _plot(results, stem + ".png")
    return stem


# -- main --------------------------------------------------------------------------------------


def _commit(label: str | None) -> str:
    if label:
        return label
    from hybrid_ep_triton.tools.bench import commit

    return commit()


def _arguments() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench/results")
    p.add_argument("--shapes", default=None, help="of S1, S2, tiny (default S1,S2; CPU: tiny)")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="default: cuda where torch sees a GPU")  # fmt: skip
    p.add_argument("--warmup", type=int, default=None, help="default 20 (CPU: 1)")
    p.add_argument("--iters", type=int, default=None, help="default 200 (CPU: 3)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--graph-calls", type=int, default=8)
    p.add_argument("--src", default=None, help="import hybrid_ep_triton from SRC/src")
    p.add_argument("--label", default=None, help="the result's name (default: the commit)")
    p.add_argument("--compare", nargs="+", default=None, metavar="RESULT_JSON")
    args = p.parse_args()
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    on_cpu = args.device == "cpu"
    args.shapes = (args.shapes or ("tiny" if on_cpu else "S1,S2")).split(",")
    unknown = set(args.shapes) - set(SHAPES)
    if unknown:
        p.error(f"unknown shapes {sorted(unknown)}; known: {', '.join(SHAPES)}")
    args.warmup = args.warmup if args.warmup is not None else (1 if on_cpu else 20)
    args.iters = args.iters if args.iters is not None else (3 if on_cpu else 200)
    return args


def main() -> int:
    args = _arguments()
    if args.compare:
        stem = _compare(args.compare, args.out)
        with open(stem + ".md") as f:
            print(f.read())
        return 0
    if args.src:
        # Before any import of the package; the rank processes (spawned) inherit sys.path.
        sys.path.insert(0, os.path.join(os.path.abspath(args.src), "src"))
    os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(_HEAP_BYTES))
    import hybrid_ep_triton
    from hybrid_ep_triton.tools.launcher import run_ranks

    print(f"hybrid_ep_triton from {os.path.dirname(hybrid_ep_triton.__file__)}", flush=True)
    opts = dict(shapes=args.shapes, device=args.device, warmup=args.warmup, iters=args.iters,
                rounds=args.rounds, graph_calls=args.graph_calls)  # fmt: skip
    (found,) = run_ranks(_rank, 1, opts, device=args.device, timeout_s=1800)
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    result = dict(
        machine=f"1x {name}", machine_slug=f"1x{name.replace('NVIDIA ', '').replace(' ', '')}",
        date=datetime.date.today().isoformat(), commit=_commit(args.label), **opts,
        **found,
    )  # fmt: skip
    result["shapes"] = [asdict(SHAPES[s]) for s in args.shapes]
    result["summary"] = _summary(result)
    stem = _write(result, args.out)
    with open(stem + ".md") as f:
        print(f.read())
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
