"""Tests of the command line (hybrid_ep_triton.cli): ``hybrid-ep demo`` end to end."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hybrid_ep_triton.cli import main

SRC = str(Path(__file__).resolve().parents[1] / "src")
# Small enough for two interpreted CPU ranks to finish well within a minute.
SMALL = ["--tokens", "8", "--hidden", "32", "--experts", "8", "--topk", "2"]


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (SRC, env.get("PYTHONPATH")) if p)
    return subprocess.run(args, capture_output=True, text=True, env=env, timeout=timeout)


def test_demo_two_ranks(device):
    if device == "cuda":
        import torch

        if torch.cuda.device_count() < 2:
            pytest.skip("needs 2 GPUs")
    cmd = [sys.executable, "-m", "hybrid_ep_triton", "demo", "--ranks", "2", "--device", device]
    r = _run(cmd + SMALL, timeout=300)
    assert r.returncode == 0, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    out = r.stdout
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
    ],
)
def test_demo_rejects_bad_sizes(argv, capsys):
    assert main(argv) == 2  # before any rank starts
    assert "hybrid-ep: error:" in capsys.readouterr().err


def test_no_command_prints_help(capsys):
    assert main([]) == 2
    assert "demo" in capsys.readouterr().out
