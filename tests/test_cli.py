"""Tests of the command line (hybrid_ep_triton.tools.cli): ``hybrid-ep demo`` end to end, how
``hybrid-ep soak`` parses its options and reports (its rank body is tested in test_soak), what
``tune`` takes by default, and ``--help``: every option explained, parsing without torch."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import skip_unless_ranks_fit

from hybrid_ep_triton.tools import launcher, mps
from hybrid_ep_triton.tools.cli import (
    COMMANDS,
    SOAK_DTYPES,
    TUNE_DTYPES,
    build_parser,
    help_with_default,
    main,
    run_soak,
)

SRC = str(Path(__file__).resolve().parents[1] / "src")
# Small enough for two interpreted CPU ranks to finish well within a minute.
SMALL = ["--tokens", "8", "--hidden", "32", "--experts", "8", "--topk", "2"]


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (SRC, env.get("PYTHONPATH")) if p)
    return subprocess.run(args, capture_output=True, text=True, env=env, timeout=timeout)


@pytest.mark.slow
def test_demo_two_ranks_as_two_nodes(device):
    skip_unless_ranks_fit(device, 2)
    cmd = [sys.executable, "-m", "hybrid_ep_triton", "demo", "--ranks", "2", "--device", device]
    r = _run(cmd + SMALL + ["--ranks-per-node", "1"], timeout=300)
    assert r.returncode == 0, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    out = r.stdout
    assert "nodes of 1 ranks" in out.splitlines()[0], out
    for column in ("rank", "rows recv", "tokens / local expert", "dispatch ms", "combine ms"):
        assert column in out
    # One table row per rank, each checked OK, then the summary line.
    rows = [line for line in out.splitlines() if line.rstrip(" │").endswith("OK")]
    assert len(rows) == 2, out
    assert "MISMATCH" not in out
    assert out.rstrip().splitlines()[-1].startswith("OK in ")


def test_module_help_lists_demo():
    r = _run([sys.executable, "-m", "hybrid_ep_triton", "--help"], timeout=120)
    assert r.returncode == 0, r.stderr
    assert "demo" in r.stdout


@pytest.mark.skipif(shutil.which("hybrid-ep") is None, reason="package not installed")
def test_console_script_help_lists_demo():
    r = _run(["hybrid-ep", "--help"], timeout=120)
    assert r.returncode == 0, r.stderr
    assert "demo" in r.stdout


@pytest.mark.parametrize(
    "argv",
    [
        ["demo", "--device", "cpu", "--ranks", "3", "--experts", "8"],  # 8 % 3 != 0
        ["demo", "--device", "cpu", "--ranks", "2", "--experts", "8", "--topk", "9"],
        ["demo", "--device", "cpu", "--ranks", "0"],
        ["demo", "--device", "cpu", "--ranks", "2", "--ranks-per-node", "3"],
        ["soak", "--device", "cpu", "--ranks", "3"],  # 8 experts by default
        ["soak", "--device", "cpu", "--rounds", "0"],
        ["soak", "--device", "cpu", "--op-timeout", "0"],
    ],
)
def test_demo_rejects_bad_sizes(argv, capsys):
    assert main(argv) == 2  # before any rank starts
    assert "hybrid-ep: error:" in capsys.readouterr().err


def test_parsing_and_help_import_neither_torch_nor_triton():
    # In a fresh interpreter: this test process has imported torch long ago.
    script = """
import sys
from hybrid_ep_triton.tools.cli import COMMANDS, build_parser
argvs = [["--help"], *([name] for name in COMMANDS), *([name, "--help"] for name in COMMANDS)]
for argv in argvs:
    try:
        build_parser().parse_args(argv)
    except SystemExit:
        pass
print("imported:", sorted(m for m in ("torch", "triton") if m in sys.modules))
"""
    r = _run([sys.executable, "-c", script], timeout=120)
    assert r.returncode == 0, r.stderr
    for name in COMMANDS:
        assert f"usage: hybrid-ep {name}" in r.stdout, r.stdout
    assert r.stdout.rstrip().splitlines()[-1] == "imported: []", r.stdout


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]


def test_every_option_says_what_it_does_and_its_default():
    for name, command in COMMANDS.items():
        parser = argparse.ArgumentParser()
        command.add_arguments(parser)
        for action in _options(parser):
            option = f"{name} {(action.option_strings or [action.dest])[0]}"
            assert action.help and action.help.strip(), f"{option} has no help"
            # A flag's default is its absence; a positional argument has none.
            if action.nargs != 0 and action.option_strings:
                assert "default" in help_with_default(action), f"{option} shows no default"


def test_dtype_names_are_those_of_the_rank_bodies():
    from hybrid_ep_triton.buffer import SUPPORTED_DTYPES
    from hybrid_ep_triton.tools.soak import DTYPES

    assert SOAK_DTYPES == tuple(DTYPES)
    assert TUNE_DTYPES == tuple(str(dtype).removeprefix("torch.") for dtype in SUPPORTED_DTYPES)


def test_tune_help_says_where_the_cache_is(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HEP_CACHE_DIR", str(tmp_path / "configs"))
    monkeypatch.setenv("COLUMNS", "1000")  # argparse wraps lines at hyphens too
    with pytest.raises(SystemExit):
        build_parser().parse_args(["tune", "--help"])
    out = capsys.readouterr().out
    assert f"stored in {tmp_path / 'configs' / 'kernel_configs.json'}" in out, out


def test_tune_takes_the_devices_defaults_and_the_options_given(monkeypatch):
    from hybrid_ep_triton.tools import tune

    taken = []
    monkeypatch.setattr(tune, "run", lambda args: taken.append(args) or 0)
    assert main(["tune", "--device", "cpu", "--chunks", "4", "--hidden", "32"]) == 0
    (args,) = taken
    assert (args.device, args.ranks, args.tokens, args.hidden, args.experts) == (
        "cpu",
        2,
        16,
        32,
        16,
    )
    assert (args.topk, args.sms, args.warmup, args.iters) == (4, 2, 1, 3)
    assert (args.chunks, args.block_h, args.slices, args.warps) == ([4], [32, 64], [1, 2], [4])
    assert (args.dtype, args.rows, args.seed) == ("bfloat16", "expert", 0)


def test_no_command_prints_help(capsys):
    assert main([]) == 2
    assert "demo" in capsys.readouterr().out


def test_soak_command_parses():
    argv = "soak --ranks 2 --rounds 10000 --device cuda --seed 7 --timeout 7200 --dtype fp16"
    args = build_parser().parse_args(argv.split() + ["--tokens", "4096", "--op-timeout", "30"])
    assert args.run is run_soak
    got = (args.ranks, args.rounds, args.device, args.seed, args.timeout, args.dtype)
    assert got == (2, 10000, "cuda", 7, 7200, "fp16")
    assert (args.tokens, args.op_timeout) == (4096, 30)
    defaults = build_parser().parse_args(["soak"])
    assert defaults.rounds is None and defaults.hidden is None  # per device, chosen at run time
    assert (defaults.device, defaults.dtype, defaults.op_timeout) == ("auto", "bf16", 60)


def _fake_soak_ranks(failures: int):
    """A run_ranks stand-in returning one soak summary per rank (rank 1 with ``failures``)."""

    def run_ranks(fn, world_size, cfg, **kwargs):
        from hybrid_ep_triton.tools.soak import _summary

        per_rank = []
        for rank in range(world_size):
            bad = failures if rank == 1 else 0
            messages = ["round 3: recv_x differs"] * bad
            s = _summary(
                rank,
                cfg,
                False,
                bad,
                messages,
                [1 << 20] * cfg.rounds,
                [2 << 20] * cfg.rounds,
                [0.01] * cfg.rounds,
            )
            per_rank.append({**s, "coverage": {"exact": cfg.rounds}})
        return per_rank

    return run_ranks


@pytest.mark.parametrize("failures", [0, 1])
def test_soak_reports_every_rank(monkeypatch, capsys, failures):
    monkeypatch.setattr(launcher, "run_ranks", _fake_soak_ranks(failures))
    code = main(["soak", "--device", "cpu", "--ranks", "2", "--rounds", "5"])
    out = capsys.readouterr().out
    assert code == (1 if failures else 0), out
    assert out.startswith("hybrid-ep soak: 2 CPU ranks"), out
    for rank in (0, 1):
        bad = failures if rank == 1 else 0
        assert f"soak rank {rank}: 5 rounds, {bad} failures;" in out, out
    assert ("  rank 1: round 3: recv_x differs" in out) == bool(failures), out
    assert "  rank 0 rounds with: exact 5" in out, out
    assert out.rstrip().splitlines()[-1].startswith("FAILED in " if failures else "OK in "), out


def test_ranks_sharing_a_gpu_without_mps_are_refused_before_any_start(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(mps, "daemon_answers", lambda: False)

    def no_start(*args, **kwargs):
        raise AssertionError("a rank was started")

    monkeypatch.setattr(launcher.mp, "get_context", no_start)
    assert main(["demo", "--device", "cuda", "--ranks", "4"]) == 2
    err = capsys.readouterr().err
    assert "4 ranks on 1 GPU(s) share GPUs" in err and mps.START in err and mps.STOP in err
