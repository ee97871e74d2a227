"""The kernels compile for Hopper (sm_90), checked on a machine without a GPU."""

import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("sm90_compile.py")
    result = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout + result.stderr
    # Five builds (layout and dispatch with expert-major and with token rows, combine) at EP2
    # and EP8 in one node, and at EP16 as 2 nodes of 8 with NVSHMEM linked; FP8 dispatch at
    # EP8 (expert-major rows) and EP16 (token rows); dispatch quantizing into FP8, MXFP8 and
    # NVFP4 and the exact-mode move whose outputs come from the host, at EP2; the MXFP8 / NVFP4
    # quantizer alone (3).
    assert result.stdout.count("REG:") == 24, result.stdout
