"""The kernels compile for Hopper (sm_90), checked on a machine without a GPU."""

import os
import subprocess
import sys
from pathlib import Path

import pytest


def _compile_for_sm90(*args: str) -> str:
    """tests/sm90_compile.py's output with ``args``, which must exit 0."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("sm90_compile.py")
    result = subprocess.run(
        [sys.executable, str(script), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_low_latency_kernels_compile_for_sm90():
    """The low-latency kernels (bf16 and FP8 dispatch, combine, farewell) at EP2 and EP8, under the
    Triton version installed: the oldest one (nox -s oldest_triton runs this) fails on some
    code that the newest compiles, e.g. a branch on a value read after a masking wait. And no
    branch of theirs depends on a volatile load or the clock read by each thread for itself
    (sm90_compile.per_warp_decisions: warps that part ways there meet at the wrong barriers;
    a plain load of a word that changes is beyond what it sees)."""
    stdout = _compile_for_sm90("--low-latency")
    assert stdout.count("REG:") == 8, stdout
    assert stdout.count("per-warp-decisions:0") == 8, stdout


@pytest.mark.slow
def test_kernels_compile_for_sm90():
    stdout = _compile_for_sm90()
    # Six builds (layout and dispatch with expert-major and with token rows, combine, and
    # combine with token rows' topk_weights) at EP2 and EP8 in one node, and at EP16 as 2 nodes
    # of 8 with NVSHMEM linked; FP8 dispatch at
    # EP8 (expert-major rows) and EP16 (token rows); dispatch quantizing into FP8, MXFP8 and
    # NVFP4 and the exact-mode move whose outputs come from the host, at EP2; the MXFP8 / NVFP4
    # quantizer alone (3); the low-latency dispatch (bf16, FP8 with UE8M0 scales), combine and
    # farewell at each of the three topologies (12).
    assert stdout.count("REG:") == 40, stdout


_CACHE_HIT_SCRIPT = """
import os, pathlib, sys
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, sys.argv[1])
from slim_triton_cache import slim

@triton.jit
def copy(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)

def build():
    signature = {"x_ptr": "*fp32", "y_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}
    return triton.compile(ASTSource(copy, signature, {"BLOCK": 64}),
                          target=GPUTarget("cuda", 90, 32))

first = build()
cache = pathlib.Path(os.environ["TRITON_CACHE_DIR"])
lies_at = pathlib.Path(sys.argv[2])  # where the slimmed cache is read: here, or moved there
assert slim([str(d) for d in cache.iterdir()], str(lies_at)) > 0
cache.rename(lies_at)
os.environ["TRITON_CACHE_DIR"] = str(lies_at)
files = lambda: sorted(str(f) for f in lies_at.rglob("*") if f.is_file())
kept = files()
assert not [f for f in kept if not f.endswith((".json", ".cubin", ".so"))]
second = build()
assert files() == kept, "compiled again"
assert set(second.asm) == {"cubin"} and second.asm["cubin"] == first.asm["cubin"]
print("served by", len(kept), "files")
"""


@pytest.mark.parametrize("read_from", ["cache", "elsewhere"])
def test_a_slimmed_cache_serves(tmp_path, read_from):
    """bench/slim_triton_cache.py keeps of Triton's cache only what a hit reads (what
    bench/device_run.sh carries between calls): a build slimmed so is found, not compiled
    again, and gives the same machine code; also from another folder that it was slimmed for
    (--lies-at: a cache made on another machine)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    script = tmp_path / "build_twice.py"  # Triton reads a kernel's source from its file
    script.write_text(_CACHE_HIT_SCRIPT)
    bench = Path(__file__).parent.parent / "bench"
    result = subprocess.run(
        [sys.executable, str(script), str(bench), str(tmp_path / read_from)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "served by" in result.stdout
