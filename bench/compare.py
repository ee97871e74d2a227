"""Tabulate benchmark runs side by side: ``python bench/compare.py A.json B.json [...]``.

Each argument is a JSON file written by ``hybrid-ep bench`` (one tree of an A/B, e.g. the
folders of device_run.sh's bench-fp8-ab step). Rows are matched by shape, layout, nodes, row
format, op, mode and SM count; the table gives each run's time (µs) and each later run's time
over the first one's, each run named by its file's folder (the trees of bench-fp8-ab all
record the checkout's commit). Rows that not every run has are left out and counted at the end.
"""

import argparse
import json
import pathlib


def _key(row: dict) -> tuple:
    rows = "expert" if row["expand"] else "token"
    nodes = row["ranks"] // row["ranks_per_node"]
    return (row["shape"], rows, f"{nodes}x{row['ranks_per_node']}", row["dtype"], row["op"],
            row["mode"], row["num_sms"])  # fmt: skip


def compare(paths: list[str]) -> str:
    runs = [json.loads(pathlib.Path(p).read_text()) for p in paths]
    times = [{_key(r): r["time_us"] for r in run["rows"]} for run in runs]
    common = [k for k in times[0] if all(k in t for t in times[1:])]
    names = [pathlib.Path(p).resolve().parent.name for p in paths]
    heads = [f"{name} µs" for name in names]
    ratios = [f"{name} / {names[0]}" for name in names[1:]]
    cols = ["shape", "rows", "nodes", "dtype", "op", "mode", "SMs", *heads, *ratios]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for k in common:
        ts = [t[k] for t in times]
        cells = [*map(str, k), *(f"{t:.1f}" for t in ts), *(f"{t / ts[0]:.3f}" for t in ts[1:])]
        lines.append("| " + " | ".join(cells) + " |")
    left = sum(len(t) for t in times) - len(common) * len(times)
    lines.append(f"\n{len(common)} rows in every run; {left} rows of single runs left out.")
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="JSON files of hybrid-ep bench, first = baseline")
    print(compare(parser.parse_args().runs))
