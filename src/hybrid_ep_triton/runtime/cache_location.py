"""Where the per-machine cache lives: the configuration cache (``runtime.tuning`` reads and
writes it) and NVSHMEM's trimmed device library (``runtime.nvshmem_bitcode``). Plain ``os`` and
``pathlib``, no torch, so that ``hybrid-ep tune --help`` can say where it writes without
importing torch."""

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$HEP_CACHE_DIR``; without it ``$XDG_CACHE_HOME/hybrid_ep_triton``, or
    ``~/.cache/hybrid_ep_triton``."""
    root = os.environ.get("HEP_CACHE_DIR")
    if root is None:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
        root = os.path.join(xdg, "hybrid_ep_triton")
    return Path(root)


def cache_path() -> Path:
    """The configuration cache: ``cache_dir() / "kernel_configs.json"``."""
    return cache_dir() / "kernel_configs.json"
