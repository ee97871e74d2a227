"""Compile the kernel builds of a run ahead of it, side by side on the host's cores.

Triton compiles each specialisation of a kernel at its first launch in a process, one after
another as a run reaches them: 1-7 s each within one node, a few seconds more where NVSHMEM's
device library is linked (across nodes), on one core of a 2-core CI machine. A run with
HEP_RECORD_BUILDS=DIR records the specialisations it built (ops/launch.record_builds);
``prebuild`` compiles those records into Triton's cache (TRITON_CACHE_DIR) over several
processes, so that a later run loads each build at its first launch instead of compiling it
there. A record names a kernel and its arguments' types, constexprs and options, not its source:
it still serves once the kernel's code has changed, as long as its parameters have not.
``hybrid-ep prebuild DIR`` runs it.

Records come from folders that others may write (a shared cache, a copied run), and a record
names a module to import and files to link: ``refusal`` lets through only this library's
kernels (``hybrid_ep_triton.kernels``) linking only NVSHMEM's device library (mapped to this
environment's) and Triton's libdevice (Triton links its own), and refuses any other record by
name before anything imports or compiles it.

With ``arch`` (``hybrid-ep prebuild --arch 90``) the builds compile for that GPU architecture on a
machine without it, or without any GPU (Triton compiles on the host; only a launch needs the
GPU), e.g. on a CPU login node or CI machine, and the cache is copied to the GPU machines. A
build there is a cache hit only where Triton's cache key agrees: the same Triton wheel for the
same Python version (the key hashes libtriton's binary, which differs per Python), the same
ptxas, and extern libraries (NVSHMEM's device bitcode, libdevice) of the same content; a recorded
library path missing here is taken from this interpreter's site-packages at the same relative
path. Where the keys differ, the GPU machine compiles at first launch as without a prebuild.
The copied cache must lie at the path it was built at: Triton's group files name a build's
parts by absolute path (bench/slim_triton_cache.py --lies-at names them at another).
"""

import functools
import json
import lzma
import multiprocessing
import os
import time
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor
from importlib import import_module
from pathlib import Path
from typing import NamedTuple

from ..runtime.nvshmem_bitcode import is_device_library, library_for_record

KERNELS_PACKAGE = "hybrid_ep_triton.kernels"


class Prebuilt(NamedTuple):
    built: int  # builds compiled now, or found in Triton's cache (distinct_builds of the records)
    stale: list[str]  # records that the kernels no longer take, each as "kernel: why"
    seconds: float
    refused: list[str]  # records not this library's kernels or linking other files, as "why"


def read_records(paths: Iterable[str | Path]) -> list[str]:
    """The distinct records in ``paths``, in the order first read: files of records, a line
    each (``.jsonl``, or ``.jsonl.xz`` compressed), or directories of them (``*.jsonl`` at any
    depth, as record_builds writes them)."""
    records: dict[str, None] = {}
    for path in map(Path, paths):
        for file in sorted(path.rglob("*.jsonl")) if path.is_dir() else [path]:
            with (lzma.open if file.suffix == ".xz" else open)(file, "rt") as lines:
                records.update((line.rstrip("\n"), None) for line in lines if line.strip())
    return list(records)


def write_records(records: list[str], path: str | Path) -> None:
    """Write ``records`` into ``path``, a line each (compressed where it ends in ``.xz``)."""
    with (lzma.open if Path(path).suffix == ".xz" else open)(path, "wt") as lines:
        lines.writelines(record + "\n" for record in records)


def prebuild(records: list[str], workers: int, arch: int | None = None) -> Prebuilt:
    """Compile ``records`` (Triton's serialised specialisations) into Triton's cache with
    ``workers`` processes, the builds that link NVSHMEM (the slowest) first. ``arch``: the
    compute capability to compile for, as Triton names it (90: H100/H200, 100: B200), on a
    machine without that GPU (``compile_only_for``); None: this machine's current GPU. Needs
    Triton's compiler: ValueError under the interpreter (TRITON_INTERPRET=1), which compiles
    nothing."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise ValueError("TRITON_INTERPRET=1: the interpreter compiles nothing; unset it")
    started = time.perf_counter()
    refused = [why for why in map(refusal, records) if why is not None]
    records = distinct_builds([record for record in records if refusal(record) is None])
    slowest_first = sorted(records, key=lambda record: "libnvshmem" not in record)
    context = multiprocessing.get_context("spawn")  # no CUDA state inherited
    initializer = None if arch is None else functools.partial(compile_only_for, arch)
    with ProcessPoolExecutor(workers, mp_context=context, initializer=initializer) as pool:
        stale = [why for why in pool.map(_build, slowest_first) if why is not None]
    return Prebuilt(len(records) - len(stale), stale, time.perf_counter() - started, refused)


def refusal(record: str) -> str | None:
    """Why ``record`` is not built, by its names alone (nothing imported, no file read): a
    kernel outside ``KERNELS_PACKAGE``, or an extern library other than NVSHMEM's device
    bitcode (or a library trimmed from it) and Triton's libdevice. None: it may be built."""
    try:
        data = json.loads(record)
        name = str(data["name"])
        libraries = [
            (str(library), str(path)) for library, path in data["options"].get("extern_libs") or []
        ]
    except (ValueError, KeyError, TypeError, AttributeError):
        return f"not a record of a kernel build: {record[:80]!r}"
    if not name.startswith(f"{KERNELS_PACKAGE}.") or ".." in name:
        return f"{name}: not a kernel of {KERNELS_PACKAGE}"
    for library, path in libraries:
        nvshmem = library == "libnvshmem_device" and is_device_library(path)
        if not (nvshmem or library == "libdevice"):
            return f"{name}: links {library} ({path}), not NVSHMEM's device library"
    return None


def distinct_builds(records: list[str]) -> list[str]:
    """``records`` as the kernels take them now, one per build: a parameter that a kernel no
    longer specialises on (its do_not_specialize, e.g. since the record was made) loses the
    value class recorded for it (the constant 1, or a multiple of 16), so that records that
    differ only there (of rank 0, rank 1 and the other ranks, say) are built once. A record
    whose kernel does not import is kept as it is (and its build says why)."""
    builds: dict[str, str] = {}
    for record in records:
        data = json.loads(record)
        module, _, name = data["name"].rpartition(".")
        try:
            kernel = getattr(import_module(module), name)
            unspecialised = {p.name for p in kernel.params if p.do_not_specialize}
        except Exception:
            unspecialised = set()
        data = without_value_classes(data, unspecialised)
        builds.setdefault(json.dumps({**data, "key": None}, sort_keys=True), json.dumps(data))
    return list(builds.values())


def without_value_classes(data: dict, names: set[str]) -> dict:
    """Record ``data`` (Triton's specialisation data, parsed) with the integer parameters
    ``names`` taken as Triton takes a do_not_specialize parameter: neither a constant (a value
    of 1) nor marked divisible by 16. Its "key" (the JIT's in-process key) is kept as it was:
    preloading does not use it to find the build in Triton's cache."""
    params = list(data["signature"])
    plain = {(params.index(name),) for name in names if name in params}
    data = dict(data, signature=dict(data["signature"]))
    for kind in ("constant", "attrs"):
        pairs = zip(data[f"{kind}_keys"], data[f"{kind}_vals"], strict=True)
        kept = [(key, value) for key, value in pairs if tuple(key) not in plain]
        data[f"{kind}_keys"] = [key for key, _ in kept]
        data[f"{kind}_vals"] = [value for _, value in kept]
    for (index,) in plain:
        if data["signature"][params[index]] == "constexpr":  # a 1: an int32, like any other
            data["signature"][params[index]] = "i32"
    return data


class _CompileOnlyDriver:
    """Triton's active driver as the JIT asks it when it compiles without launching
    (``JITFunction.preload``, ``warmup``): device 0, a GPU of compute capability ``arch``, and
    no stream. A launch through it fails."""

    def __init__(self, arch: int):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0


def triton_key_digest() -> str:
    """The first 16 hex digits of the sha256 of Triton's own cache key part (its wheel, for this
    Python): every build's key begins with it, so a cache compiled on another machine can serve
    here only where that machine's digest is the same."""
    import hashlib

    from triton.runtime.cache import triton_key

    return hashlib.sha256(triton_key().encode()).hexdigest()[:16]


def compile_only_for(arch: int) -> None:
    """Let this process's JIT compile for compute capability ``arch`` (90: sm_90) without that
    GPU: ``JITFunction.preload`` and ``warmup`` compile into Triton's cache; a launch fails."""
    import triton

    triton.runtime.driver.set_active(_CompileOnlyDriver(arch))


def with_local_libraries(data: dict) -> dict:
    """Record ``data`` (parsed, accepted by ``refusal``) with its extern libraries as this
    machine's runs link them: NVSHMEM's trimmed device library made here from this
    environment's NVSHMEM, whether the record names the whole bitcode (records made before the
    library was trimmed) or a library trimmed on another machine
    (``runtime.nvshmem_bitcode.library_for_record``); the recorded libdevice left out, for
    Triton adds its own (TRITON_LIBDEVICE_PATH, or the one in its wheel) as it does in a run.
    Triton's cache key hashes a library's content, not its path."""
    libraries = data["options"].get("extern_libs") or []
    local = [
        [name, library_for_record(path)] for name, path in libraries if name == "libnvshmem_device"
    ]
    return dict(data, options=dict(data["options"], extern_libs=local)) if libraries else data


def _build(record: str) -> str | None:
    """Compile one record that ``refusal`` accepted (JITFunction.preload, the current source of
    the kernel it names); returns why it could not, or None."""
    from triton.runtime.jit import JITFunction

    data = json.loads(record)
    name = data["name"]
    module, _, kernel = name.rpartition(".")
    try:
        function = getattr(import_module(module), kernel)
        if not isinstance(function, JITFunction):
            return f"{name}: not a Triton kernel"
        function.preload(json.dumps(with_local_libraries(data)))
    except Exception as error:  # a kernel renamed, or whose parameters changed since
        return f"{name}: {type(error).__name__}: {error}"
    return None
