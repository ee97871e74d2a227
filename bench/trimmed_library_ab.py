"""NVSHMEM's trimmed device library against its whole bitcode, on recorded builds: build time and
machine code (runtime/nvshmem_bitcode.py), compiled for sm_90 on this machine, no GPU needed.

Usage: python bench/trimmed_library_ab.py bench/builds/soak-shared.jsonl.xz [--builds 6]
Takes the first recorded build of each kernel that links NVSHMEM, then further dispatch builds
up to --builds, and compiles each twice into fresh Triton caches, one process at a time (the
trimmed library made beforehand, as a run finds it in its cache): prints a line each with both
times and both SASS digests, and the medians. Run it on an otherwise idle machine.
"""

import argparse
import hashlib
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from hybrid_ep_triton.runtime.nvshmem_bitcode import installed_file, trimmed_library  # noqa: E402
from hybrid_ep_triton.tools.prebuild import (  # noqa: E402
    compile_only_for,
    read_records,
    with_local_libraries,
)


def sass_digest(cubin: bytes) -> str:
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout
    return hashlib.sha256(out.encode()).hexdigest()[:16]


def build(data: dict, cache: str) -> tuple[float, str]:
    """Seconds to compile ``data`` (a record) into the empty cache ``cache``, and its digest."""
    os.environ["TRITON_CACHE_DIR"] = cache
    module, _, name = data["name"].rpartition(".")
    kernel = getattr(importlib.import_module(module), name)
    kernel.device_caches.clear()  # nothing of an earlier build kept in this process
    started = time.perf_counter()
    compiled = kernel.preload(json.dumps(data))
    return time.perf_counter() - started, sass_digest(compiled.asm["cubin"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("records", nargs="+")
    parser.add_argument("--builds", type=int, default=6)
    args = parser.parse_args()
    compile_only_for(90)
    linked = [json.loads(r) for r in read_records(args.records) if "libnvshmem" in r]
    firsts = {data["name"]: data for data in reversed(linked)}
    chosen = list(firsts.values())
    chosen += [d for d in linked if d not in chosen and "dispatch" in d["name"]][
        : args.builds - len(chosen)
    ]
    # NVSHMEM's bitcode for sm_90 as pip installs it (no nvshmem4py needed to find it).
    found = (installed_file(f"nvidia/nvshmem/lib/{name}")
             for name in ("libnvshmem_device_sm_90.bc", "libnvshmem_device.bc"))  # fmt: skip
    whole = str(next(path for path in found if path))
    trimmed = str(trimmed_library(whole))
    print(f"# Triton {triton.__version__}; whole bitcode {whole} ({os.path.getsize(whole)} B); "
          f"trimmed {trimmed} ({os.path.getsize(trimmed)} B)")  # fmt: skip
    times = {"trimmed": [], "whole": []}
    for data in chosen:
        line = {"kernel": data["name"].rpartition(".")[2]}
        for label, library in (("trimmed", trimmed), ("whole", whole)):
            local = with_local_libraries(data)
            libraries = [[n, library if n == "libnvshmem_device" else p]
                         for n, p in local["options"]["extern_libs"]]  # fmt: skip
            local["options"] = dict(local["options"], extern_libs=libraries)
            with tempfile.TemporaryDirectory() as cache:
                seconds, digest = build(local, cache)
            times[label].append(seconds)
            line[label] = {"s": round(seconds, 2), "sass": digest}
        line["same_sass"] = line["trimmed"]["sass"] == line["whole"]["sass"]
        print(json.dumps(line), flush=True)
    print(json.dumps({name: round(statistics.median(t), 2) for name, t in times.items()}))


if __name__ == "__main__":
    main()
