"""NVSHMEM's device library, which Triton links into the kernels across nodes, trimmed to the
functions they call.

NVSHMEM ships its device code as LLVM bitcode (``libnvshmem_device_sm_90.bc``, 52 MB in 3.8;
``libnvshmem_device.bc`` before 3.5). Triton's link parses the whole file at every build of a
kernel that calls NVSHMEM, a third of such a build's time, for the few functions the kernels
call (``DEVICE_CALLS``, kernels/primitives.py). ``device_library`` links those out of it
once, with Triton's own LLVM, into a small file of textual IR in the cache directory
(``cache_location.cache_dir() / "nvshmem"``), and gives Triton that: the same sm_90 code (SASS
identical), in less time.

No torch here: ``tools.prebuild`` maps recorded libraries with it in an environment that has
only Triton and NVSHMEM's wheel.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import site
import tempfile
import warnings
from pathlib import Path

from .cache_location import cache_dir

__all__ = [
    "DEVICE_CALLS",
    "bitcode_file",
    "device_library",
    "installed_file",
    "is_device_library",
    "library_for_record",
]

# The NVSHMEM device functions the kernels call, with their LLVM signatures in NVSHMEM's
# bitcode (nvshmemx.h, nvshmem.h), as MLIR declarations.
DEVICE_CALLS = {
    "nvshmemx_putmem_signal_block": "(!llvm.ptr, !llvm.ptr, i64, !llvm.ptr, i64, i32, i32) -> ()",
    "nvshmemx_signal_op": "(!llvm.ptr, i64, i32, i32) -> ()",
    "nvshmemx_putmem_block": "(!llvm.ptr, !llvm.ptr, i64, i32) -> ()",
    "nvshmem_fence": "() -> ()",
}
# NVSHMEM's device bitcode file's name (one per architecture from 3.5), and a trimmed
# library's: the bitcode file's stem, then a digest of what made it.
_BITCODE_NAME = re.compile(r"libnvshmem_device(_sm_\d+)?\.bc")
_TRIMMED_NAME = re.compile(r"(?P<stem>libnvshmem_device(_sm_\d+)?)-[0-9a-f]{16}\.ll")


def bitcode_file(arch: str | None = None) -> str:
    """NVSHMEM's device bitcode, found by nvshmem4py. NVSHMEM 3.5 and later ship one file per
    architecture (``libnvshmem_device_sm_90.bc``), earlier versions one for all
    (``libnvshmem_device.bc``). ``arch`` (e.g. "90") names the architecture where no GPU is
    there to pick it by; None: the current device's."""
    import nvshmem.core as nvshmem

    if arch is None:
        return nvshmem.find_device_bitcode_library()
    try:
        return nvshmem.find_device_bitcode_library(arch=arch)
    except Exception:  # NVSHMEM before 3.5: the one file
        return nvshmem.find_device_bitcode_library()


def device_library(arch: str | None = None) -> dict[str, str]:
    """Triton's ``extern_libs`` for the kernels that call NVSHMEM: ``bitcode_file(arch)``
    trimmed to ``DEVICE_CALLS``."""
    return {"libnvshmem_device": str(trimmed_library(bitcode_file(arch)))}


def is_device_library(path: str) -> bool:
    """Whether ``path`` is named as NVSHMEM's device bitcode or a library trimmed from it
    (``library_for_record`` maps it to this environment's; other files are not linked)."""
    name = Path(path).name
    return bool(_BITCODE_NAME.fullmatch(name) or _TRIMMED_NAME.fullmatch(name))


def library_for_record(path: str) -> str:
    """The library to build a recorded kernel with (``tools.prebuild``), for a record's NVSHMEM
    library ``path`` made on another machine, trimmed or not: the trimmed library made here
    from the same bitcode file of this environment's NVSHMEM (``nvidia/nvshmem/lib/`` under
    site-packages), as this machine's runs would link. Never ``path`` itself: ValueError where
    it is not named as NVSHMEM's (``is_device_library``), FileNotFoundError where this
    environment's NVSHMEM has no such file."""
    name = Path(path).name
    if not is_device_library(name):
        raise ValueError(f"{path} is not NVSHMEM's device library")
    trimmed = _TRIMMED_NAME.fullmatch(name)
    bitcode = f"{trimmed['stem']}.bc" if trimmed else name
    source = installed_file(f"nvidia/nvshmem/lib/{bitcode}")
    if source is None:
        raise FileNotFoundError(f"this environment's NVSHMEM has no {bitcode}")
    return str(trimmed_library(str(source)))


def installed_file(relative: str) -> Path | None:
    """The file at ``relative`` below this interpreter's site-packages (where pip installs
    ``nvidia/nvshmem/lib/``), or None."""
    here = (Path(root) / relative for root in site.getsitepackages())
    return next((candidate for candidate in here if candidate.exists()), None)


@functools.cache
def trimmed_library(source: str) -> Path | str:
    """The library trimmed from bitcode file ``source``, made on the first call for it on this
    machine (a few seconds) and kept in the cache directory under a name that digests
    ``source``'s content and Triton's version. ``source`` itself, with a warning, where
    Triton's LLVM bindings cannot make it (a Triton this was not checked with)."""
    import triton

    digest = hashlib.sha256(Path(source).read_bytes())
    digest.update(f"{triton.__version__} {sorted(DEVICE_CALLS.items())}".encode())
    path = cache_dir() / "nvshmem" / f"{Path(source).stem}-{digest.hexdigest()[:16]}.ll"
    if path.exists():
        return path
    try:
        text = _link_device_calls(source)
    except Exception as error:
        warnings.warn(
            f"hybrid_ep_triton: could not trim NVSHMEM's device library with Triton "
            f"{triton.__version__} ({type(error).__name__}: {error}); linking all of {source}, "
            f"which makes each build of a kernel across nodes slower",
            stacklevel=2,
        )
        return source
    path.parent.mkdir(parents=True, exist_ok=True)
    # Every rank of a machine may make it at once: each writes its own file, then renames it.
    with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as out:
        out.write(text)
    os.replace(out.name, path)
    return path


def _link_device_calls(source: str) -> str:
    """LLVM IR holding ``DEVICE_CALLS`` and what they need from ``source`` (functions, NVSHMEM's
    device-state globals), linked by Triton's own LLVM as it links a kernel's extern libraries."""
    from triton._C.libtriton import ir, llvm

    declarations = "".join(f"  llvm.func @{name}{sig}\n" for name, sig in DEVICE_CALLS.items())
    context = ir.context()
    ir.load_dialects(context)
    with tempfile.TemporaryDirectory() as scratch:
        mlir = Path(scratch) / "declarations.mlir"
        mlir.write_text("module {\n" + declarations + "}\n")
        llvm_context = llvm.context()  # must outlive the module
        module = llvm.to_module(ir.parse_mlir_module(str(mlir), context), llvm_context)
    llvm.link_extern_libs(module, [source])
    # Triton's link makes the functions it links internal; a kernel's link needs the calls' own
    # definitions visible again.
    calls = "|".join(DEVICE_CALLS)
    text, made_visible = re.subn(
        rf"^define internal ((?:\S+ )*@(?:{calls})\()", r"define \1", str(module), flags=re.M
    )
    if made_visible != len(DEVICE_CALLS):
        raise RuntimeError(f"{made_visible} of {len(DEVICE_CALLS)} NVSHMEM functions linked")
    return text
