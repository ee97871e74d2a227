"""Where the per-machine configuration cache lives (``runtime.tuning`` reads and writes it).
Plain ``os`` and ``pathlib``, no torch, so that ``hybrid-ep tune --help`` can say where it writes
without importing torch."""

import os
from pathlib import Path


def cache_path() -> Path:
    """``$HEP_CACHE_DIR/kernel_configs.json``; without it ``$XDG_CACHE_HOME/hybrid_ep_triton/``,
    or ``~/.cache/hybrid_ep_triton/``, then ``kernel_configs.json``."""
    root = os.environ.get("HEP_CACHE_DIR")
    if root is None:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
        root = os.path.join(xdg, "hybrid_ep_triton")
    return Path(root) / "kernel_configs.json"
