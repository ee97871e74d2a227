"""NVSHMEM's device library trimmed to the kernels' calls (runtime/nvshmem_bitcode.py): what it
holds, that it changes no machine code, and that a prebuild maps records onto it."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("nvshmem.core", reason="needs nvshmem4py (the [cu13] extra)")

from hybrid_ep_triton.runtime import nvshmem_bitcode  # noqa: E402
from hybrid_ep_triton.tools.prebuild import with_local_libraries  # noqa: E402


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    """A cache directory holding the trimmed library, made once for this module (a link of
    NVSHMEM's whole bitcode: seconds)."""
    root = tmp_path_factory.mktemp("hep-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HEP_CACHE_DIR", str(root))
        nvshmem_bitcode.trimmed_library.cache_clear()
        nvshmem_bitcode.device_library(arch="90")
    nvshmem_bitcode.trimmed_library.cache_clear()
    return root


@pytest.fixture
def in_cache(cache_dir, monkeypatch) -> Path:
    monkeypatch.setenv("HEP_CACHE_DIR", str(cache_dir))
    nvshmem_bitcode.trimmed_library.cache_clear()
    yield cache_dir
    nvshmem_bitcode.trimmed_library.cache_clear()


def test_the_trimmed_library_defines_the_calls_and_is_made_once(in_cache):
    source = nvshmem_bitcode.bitcode_file(arch="90")
    made = sorted((in_cache / "nvshmem").iterdir())
    assert len(made) == 1 and made[0].name.startswith(Path(source).stem + "-"), made
    before = made[0].stat().st_mtime_ns
    path = Path(nvshmem_bitcode.device_library(arch="90")["libnvshmem_device"])
    assert path == made[0] and path.stat().st_mtime_ns == before, "made again"
    text = path.read_text()
    definitions = re.findall(r"^define (internal )?.*?@(\w+)\(", text, flags=re.M)
    defined = {name: internal for internal, name in definitions}
    for call in nvshmem_bitcode.DEVICE_CALLS:  # linkable by a kernel: not internal
        assert defined.get(call) == "", (call, defined.get(call))
    # NVSHMEM's device state, which nvshmemx_cumodule_init fills in each kernel's module.
    assert re.search(r"^@nvshmemi_device_state_d = ", text, flags=re.M)
    assert path.stat().st_size < os.path.getsize(source) / 10


def test_prebuild_builds_records_with_this_machines_trimmed_library(in_cache):
    """A record made elsewhere names NVSHMEM's whole bitcode (made before the library was
    trimmed) or a library trimmed there; either is built with the one trimmed here, as this
    machine's runs link it. Triton adds its own libdevice, as in a run."""
    trimmed = nvshmem_bitcode.device_library(arch="90")["libnvshmem_device"]
    stem = Path(nvshmem_bitcode.bitcode_file(arch="90")).stem
    elsewhere = "/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nvshmem/lib"
    libdevice = ["libdevice", "/elsewhere/libdevice.10.bc"]
    for recorded in (
        f"{elsewhere}/{stem}.bc",
        f"/root/.cache/hybrid_ep_triton/nvshmem/{stem}-{'0' * 16}.ll",
    ):
        data = {"options": {"extern_libs": [["libnvshmem_device", recorded], libdevice]}}
        local = with_local_libraries(data)["options"]["extern_libs"]
        assert local == [["libnvshmem_device", trimmed]], recorded


# (the four compiles side by side, in forked workers that inherit the builds)
_SAME_CODE_SCRIPT = """
import multiprocessing
import os
import sys
import triton
sys.path.insert(0, sys.argv[1])
import sm90_compile
from hybrid_ep_triton.runtime.nvshmem_bitcode import bitcode_file

whole = {"libnvshmem_device": bitcode_file(arch="90")}
combines = [build for build in sm90_compile.builds(topologies=((4, 2),))
            if build[0].endswith("combine_kernel")]
jobs = [(i, libs) for i in range(len(combines)) for libs in ("trimmed", "whole")]

def digest(job):
    i, libs = job
    _, source, options = combines[i]
    assert options["extern_libs"] != whole
    if libs == "whole":
        options = dict(options, extern_libs=whole)
    compiled = triton.compile(source, target=sm90_compile.SM90, options=options)
    return sm90_compile._sass_digest(compiled.asm["cubin"])

with multiprocessing.get_context("fork").Pool(os.cpu_count()) as pool:
    digests = iter(pool.map(digest, jobs))
for label, _, _ in combines:
    print(label, next(digests), next(digests))
"""


@pytest.mark.slow
def test_the_trimmed_library_gives_the_same_machine_code(in_cache, tmp_path):
    """The combine kernels of 2 nodes of 2 (normal and low-latency mode), which call both
    functions, compiled for sm_90 with the trimmed library and with NVSHMEM's whole bitcode:
    the same SASS."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    result = subprocess.run(
        [sys.executable, "-c", _SAME_CODE_SCRIPT, str(Path(__file__).parent)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert [line.split()[-3] for line in lines] == [
        "combine_kernel",
        "low_latency_combine_kernel",
    ], lines
    for line in lines:
        label, trimmed, full = line.rsplit(" ", 2)
        assert "NVSHMEM" in label and trimmed == full, line
