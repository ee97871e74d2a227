"""Tune the low-latency kernels' launch settings on one GPU, world 1: each setting's dispatch
(bf16, FP8) and combine, checked against plain torch, timed as a call in a CUDA graph of 8
(bench/low_latency.py's method and checks), in one run.

A setting overrides module constants before a Buffer is built (its launchers read them then):
  warps    ops/low_latency._WARPS: warps of every low-latency program
  groups   runtime/planner.LOW_LATENCY_ROW_GROUPS: 128-channel groups of a dispatch program's
           chunk of a token's row (a power of two)
  fp8_groups  runtime/planner.LOW_LATENCY_FP8_GROUPS: the same with FP8
  block    ops/low_latency._COMBINE_BLOCK_H: columns of a combine tile
  parts    ops/low_latency._SUM_PARTS: column parts of a slice, a combine program each
  stages   ops/low_latency._STAGES: software pipelining of the copy and sum loops
``--settings default`` times the tree's own constants only (an older tree, in an A/B).

Usage (on a GPU machine): python bench/low_latency_sweep.py [--out DIR] [--settings S;S;...]
with S as ``warps=8,groups=32``.
Writes <out>/<date>-<machine>-low-latency-sweep-<commit>.{json,md,png}.
"""

from __future__ import annotations

from functools import partial

from low_latency import (
    _CALLS,
    _SETS,
    EXPERTS,
    HIDDEN,
    _check_combine,
    _check_dispatch,
    _inputs,
    _timed,
    arguments,
    run,
)

_KNOBS = {
    "warps": [("hybrid_ep_triton.ops.low_latency", "_WARPS")],
    "groups": [("hybrid_ep_triton.ops.low_latency", "LOW_LATENCY_ROW_GROUPS")],
    "fp8_groups": [("hybrid_ep_triton.runtime.planner", "LOW_LATENCY_FP8_GROUPS"),
                   ("hybrid_ep_triton.ops.low_latency", "LOW_LATENCY_FP8_GROUPS")],
    "block": [("hybrid_ep_triton.ops.low_latency", "_COMBINE_BLOCK_H")],
    "parts": [("hybrid_ep_triton.ops.low_latency", "_SUM_PARTS")],
    "stages": [("hybrid_ep_triton.ops.low_latency", "_STAGES")],
}  # fmt: skip
# (default first and last: the drift over the run)
_DEFAULT_SETTINGS = (
    "default;warps=8;groups=8;groups=32;groups=32,warps=8;parts=4;block=2048;"
    "block=2048,warps=8;stages=2;parts=4,stages=2;parts=1,block=2048,warps=8;default"
)


def _parse(setting: str) -> dict:
    if setting == "default":
        return {}
    pairs = [item.split("=") for item in setting.split(",")]
    unknown = [name for name, _ in pairs if name not in _KNOBS]
    if unknown:
        raise SystemExit(f"unknown knob(s) {unknown}: pick from {sorted(_KNOBS)}")
    return {name: int(value) for name, value in pairs}


def _apply(overrides: dict) -> dict:
    """Set the overrides; returns the values they replaced (to restore)."""
    import importlib

    replaced = {}
    for name, value in overrides.items():
        for module_name, attr in _KNOBS[name]:
            module = importlib.import_module(module_name)
            replaced[(module_name, attr)] = getattr(module, attr)
            setattr(module, attr, value)
    return replaced


def _restore(replaced: dict) -> None:
    import importlib

    for (module_name, attr), value in replaced.items():
        setattr(importlib.import_module(module_name), attr, value)


def _measure(tokens: int, sets, warmup: int, iters: int) -> tuple[dict, list]:
    """µs a call in a graph of _CALLS, per kind of call, with the current constants."""
    import hybrid_ep_triton as hep

    ll = hep.Buffer(None, hidden_size=HIDDEN, max_tokens_per_rank=tokens, num_experts=EXPERTS,
                    low_latency_tokens=tokens)  # fmt: skip
    errors, found = [], {}

    def dispatch(x, i, **kw):
        return ll.low_latency_dispatch(x, i, tokens, EXPERTS, **kw)

    for name, kw in {"dispatch bf16": dict(use_fp8=False),
                     "dispatch fp8": dict(use_fp8=True)}.items():  # fmt: skip
        x, i, _ = sets[0]
        recv, count, handle, _, _ = dispatch(x, i, **kw)
        problem = _check_dispatch(x, i, recv, count, handle, "fp8" in name, False)
        if problem:
            errors.append(f"{name}: {problem}")
        make = lambda x, i, w, kw=kw: partial(dispatch, x, i, **kw)  # noqa: E731
        found[name] = _timed(make, sets, warmup, iters)[1]
    combine_sets = []
    for x, i, w in sets:
        recv, _, handle, _, _ = dispatch(x, i, use_fp8=False)
        y = recv * 2
        if not combine_sets:
            problem = _check_combine(x, i, w, ll.low_latency_combine(y, i, w, handle)[0])
            if problem:
                errors.append(f"combine: {problem}")
        combine_sets.append((y, i, w, handle))
    make = lambda *c: partial(ll.low_latency_combine, *c)  # noqa: E731
    found["combine bf16"] = _timed(make, combine_sets, warmup, iters)[1]
    ll.destroy()
    return found, errors


def _rank(rank: int, world: int, opts: dict) -> dict:
    sets = [_inputs(opts["tokens"], seed) for seed in range(_SETS)]
    results, problems = [], []
    for setting in opts["settings"]:
        replaced = _apply(_parse(setting))
        try:
            found, errors = _measure(opts["tokens"], sets, opts["warmup"], opts["iters"])
        finally:
            _restore(replaced)
        results.append(dict(setting=setting, us=found))
        problems += [f"{setting}: {e}" for e in errors]
        print(setting, {k: round(v, 2) for k, v in found.items()}, errors or "", flush=True)
    return dict(results=results, errors=problems)


def _write(result: dict, out_dir: str) -> str:
    from hybrid_ep_triton.tools.bench import write_report

    kinds = list(result["results"][0]["us"])
    lines = [
        f"# Low-latency launch settings, world 1: {result['machine']}",
        "",
        f"date {result['date']}, commit {result['commit']}; {result['tokens']} tokens, hidden "
        f"{HIDDEN}, top-8 of {EXPERTS} experts; µs a call in a CUDA graph of {_CALLS} "
        "(median of replays); knobs in bench/low_latency_sweep.py",
        "",
        "| setting | " + " | ".join(kinds) + " |",
        "|---|" + "---:|" * len(kinds),
    ]
    for r in result["results"]:
        times = " | ".join(f"{r['us'][k]:.2f}" for k in kinds)
        lines.append(f"| {r['setting']} | {times} |")
    return write_report(out_dir, f"low-latency-sweep-{result['commit']}", lines, result, _plot)


def _plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = list(result["results"][0]["us"])
    names = [r["setting"] for r in result["results"]]
    fig, ax = plt.subplots(figsize=(9, 0.5 * len(names) + 1.5))
    height = 0.8 / len(kinds)
    for n, kind in enumerate(kinds):
        ax.barh([y + n * height for y in range(len(names))],
                [r["us"][kind] for r in result["results"]], height=height, label=kind)  # fmt: skip
    ax.set_yticks([y + 0.4 - height / 2 for y in range(len(names))], names, fontsize=7)
    ax.invert_yaxis()
    ax.axvline(10, color="k", ls=":", label="10 µs")
    ax.set_xlabel(f"µs a call in a CUDA graph of {_CALLS} (median)")
    ax.set_title(f"Low-latency launch settings, world 1: {result['machine']}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = arguments(__doc__.split("\n\n")[0])
    p.add_argument("--settings", default=_DEFAULT_SETTINGS)
    args = p.parse_args()
    settings = args.settings.split(";")
    for setting in settings:
        _parse(setting)
    return run(_rank, args, _write, settings=settings)


if __name__ == "__main__":
    raise SystemExit(main())
