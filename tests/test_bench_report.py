"""bench's report (tools/bench.py ``_write``): the JSON, the Markdown table of every row, copy and
baseline, and the plot, from a result as a run on the GPU leaves it (no GPU needed); and
bench/compare.py's table of several runs."""

from __future__ import annotations

import json

import pytest

from hybrid_ep_triton.tools import bench


def _result(shapes: tuple[str, ...], kinds: tuple[str, ...]) -> dict:
    rows = [
        dict(
            dtype=kind,
            shape=shape,
            tokens=4096,
            hidden=7168,
            topk=8,
            experts=256,
            ranks=1,
            op="dispatch",
            mode=mode,
            expand=expand,
            num_sms=sms,
            time_us=100.0 + i,
            host_us=10.0,
            ranks_per_node=1,
            net_rows=0,
            algo_GBps=500.0 - i,
            nvlink_GBps=0.0,
            net_GBps=0.0,
        )
        for i, (shape, kind, mode, expand, sms) in enumerate(
            (shape, kind, mode, expand, sms)
            for shape in shapes
            for kind in kinds
            for mode in ("exact", "graph")
            for expand in (True, False)
            for sms in (8, 24)
        )
    ]
    copies = [
        dict(name="bf16 copy (torch clone)", tokens=4096, hidden=7168, time_us=31.6, GBps=3713.0)
    ]
    baselines = [
        dict(shape=shapes[0], name="nccl_alltoall", op="dispatch", time_us=2986.5, algo_GBps=20.0)
    ]
    return dict(
        machine="1x NVIDIA H200",
        machine_slug="1xH200",
        date="2026-12-03",
        commit="abc1234",
        ranks=1,
        ceiling_GBps=2083.0,
        rows=rows,
        baselines=baselines,
        copies=copies,
        errors=[],
    )


@pytest.mark.parametrize(
    "shapes, kinds",
    [(("S1",), ("bf16", "fp8", "nvfp4-quantize")), (("S1", "S2"), ("bf16",))],
    ids=["one shape with formats", "two shapes, bf16"],
)
def test_report_has_every_row_and_a_plot(tmp_path, monkeypatch, shapes, kinds):
    figure = pytest.importorskip("matplotlib.figure")  # the bench extra (nox -s tests has it)
    titles = []
    save = figure.Figure.savefig

    def savefig(fig, *args, **kwargs):
        titles.extend(ax.get_title() for ax in fig.axes)
        return save(fig, *args, **kwargs)

    monkeypatch.setattr(figure.Figure, "savefig", savefig)
    result = _result(shapes, kinds)
    stem = bench._write(result, str(tmp_path))
    # A panel per shape that ran, and one of the row formats where formats ran.
    want = [f"{s}, EP1, 1x NVIDIA H200" for s in shapes]
    want += ["S1, row formats, 8 SMs, EP1"] if len(kinds) > 1 else []
    assert titles == want
    assert json.loads(open(stem + ".json").read()) == result
    md = open(stem + ".md").read()
    table = [line for line in md.splitlines() if line.startswith(f"| {shapes[0]} | 1x1 |")]
    table += [line for line in md.splitlines() if len(shapes) > 1 and line.startswith("| S2 |")]
    assert len(table) == len(result["rows"])
    assert "| bf16 copy (torch clone) (4096x7168) | 31.6 | 3713 |" in md
    assert "| S1 | nccl_alltoall | dispatch | 2986.5 | 20 |" in md
    with open(stem + ".png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_compare_tabulates_the_rows_every_run_has(tmp_path):
    """bench/compare.py: one line per row that every run has, each run's time and each later
    run's over the first one's, runs named by their folders; rows of single runs counted."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parent.parent / "bench" / "compare.py"
    spec = importlib.util.spec_from_file_location("compare", path)
    compare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compare)
    old, new = _result(("S1",), ("bf16",)), _result(("S1",), ("bf16", "fp8"))
    for row in new["rows"]:
        row["time_us"] *= 1.5
    paths = []
    for name, result in (("main", old), ("branch", new)):
        (tmp_path / name).mkdir()
        paths.append(str(tmp_path / name / "run.json"))
        (tmp_path / name / "run.json").write_text(json.dumps(result))
    table = compare.compare(paths).splitlines()
    assert "| main µs | branch µs | branch / main |" in table[0]
    t, n = old["rows"][0]["time_us"], len(old["rows"])
    assert (
        table[2]
        == f"| S1 | expert | 1x1 | bf16 | dispatch | exact | 8 | {t:.1f} | {t * 1.5:.1f} | 1.500 |"
    )
    assert len(table) == 2 + n + 2  # header, rule, the rows, a blank line, the count
    assert table[-1] == f"{n} rows in every run; {n} rows of single runs left out."


def _git_repo(path, name: str) -> str:
    """A git repository at path with one commit of a tracked __init__.py; its short hash."""
    import subprocess

    path.mkdir()
    (path / "__init__.py").write_text(f"# {name}\n")
    git = [
        "git",
        "-C",
        str(path),
        "-c",
        "user.name=t",
        "-c",
        "user.email=t@t",
        "-c",
        "commit.gpgsign=false",
    ]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "__init__.py"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", name], check=True)
    out = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip()


def test_commit_names_the_package_not_the_working_folder(tmp_path, monkeypatch):
    """A result names the commit of the code it measured: the checkout the package is imported
    from, not the git repository the command runs in; an installed package (no checkout) names
    its distribution's version; HEP_COMMIT overrides both."""
    import importlib.metadata
    import shutil

    if shutil.which("git") is None:
        pytest.skip("needs git")
    try:
        version = importlib.metadata.version("hybrid-ep-triton")
    except importlib.metadata.PackageNotFoundError:  # imported from src/ without an install
        version = "unknown"
    monkeypatch.delenv("HEP_COMMIT", raising=False)
    elsewhere = _git_repo(tmp_path / "elsewhere", "elsewhere")
    package = _git_repo(tmp_path / "package", "package")
    assert elsewhere != package
    monkeypatch.chdir(tmp_path / "elsewhere")

    def imported_from(path):  # raising=False: before, bench had no package_dir
        monkeypatch.setattr(bench, "package_dir", lambda: str(path), raising=False)

    imported_from(tmp_path / "package")
    assert bench.commit() == package
    # Installed (not a checkout): the version, even when run from inside a git repository.
    (tmp_path / "site-packages").mkdir()
    imported_from(tmp_path / "site-packages")
    assert bench.commit() == version
    # A package directory inside a repository that does not track it (a venv in a clone).
    (tmp_path / "elsewhere" / "venv").mkdir()
    (tmp_path / "elsewhere" / "venv" / "__init__.py").write_text("")
    imported_from(tmp_path / "elsewhere" / "venv")
    assert bench.commit() == version
    monkeypatch.setenv("HEP_COMMIT", "feedbee")
    assert bench.commit() == "feedbee"
