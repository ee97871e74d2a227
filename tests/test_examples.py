"""examples/torchrun_moe.py runs as the README shows it, under torchrun, and its layer matches the
same layer computed without communication on every rank; the README quotes it word for word.
examples/experts_decode.py likewise runs its decode step, in bf16 and in FP8."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run_example(device, script: str, *args: str) -> None:
    """``script`` of examples/ under torchrun with a rank per GPU (CPU: 2 ranks): it must exit
    0, every rank's report line saying OK."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the script sets it
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH")) if p)
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
        ranks = 2
    else:
        import torch

        ranks = torch.cuda.device_count()
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={ranks}",
        str(ROOT / "examples" / script),
        *args,
    ]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    # Each rank's report, found in the whole output: ranks print at once, and an unbuffered
    # stdout (PYTHONUNBUFFERED) writes a line's text and its newline apart, so that two
    # reports may share a line.
    reports = sorted(re.findall(r"rank (\d+)/(\d+): .*?\((OK|TOO LARGE)\)", r.stdout))
    assert [(int(i), int(n)) for i, n, _ in reports] == [(i, ranks) for i in range(ranks)], r.stdout
    assert all(verdict == "OK" for _, _, verdict in reports), r.stdout


@pytest.mark.slow
def test_torchrun_example(device):
    _run_example(device, "torchrun_moe.py")


@pytest.mark.slow
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_experts_decode_example(device, fp8):
    _run_example(device, "experts_decode.py", *(["--fp8"] if fp8 else []))


def test_readme_quotes_the_example_as_it_is():
    readme = (ROOT / "README.md").read_text()
    opening = "The heart of it:\n\n```python\n"
    start = readme.index(opening) + len(opening)
    quoted = readme[start : readme.index("\n```", start)]
    assert quoted in (ROOT / "examples" / "torchrun_moe.py").read_text()
