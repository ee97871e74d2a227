"""DeepEP's Python API over ``hybrid_ep_triton.Buffer``: a drop-in for frameworks that speak it.

``import hybrid_ep_triton.deep_ep as deep_ep`` in code of your own; for code you do not edit
(Megatron-Core's flex dispatcher, vLLM, SGLang), call ``register()`` once before it imports
``deep_ep``: from then on ``import deep_ep`` (and its submodules ``deep_ep.utils``,
``deep_ep.utils.event``, ``deep_ep.buffer``, ``deep_ep.buffers.legacy``,
``deep_ep.hybrid_ep_buffer``) gives this package. What differs from DeepEP, call by call:
docs/deep_ep.md.
"""

import sys

from . import buffer, buffers, hybrid_ep_buffer, utils
from .buffer import Buffer, topk_idx_t
from .config import Config, get_low_latency_rdma_size_hint
from .hybrid_ep_buffer import HybridEPBuffer
from .utils import event
from .utils.event import EventHandle, EventOverlap

__all__ = [
    "Buffer",
    "Config",
    "EventHandle",
    "EventOverlap",
    "HybridEPBuffer",
    "get_low_latency_rdma_size_hint",
    "register",
    "topk_idx_t",
]

# The module names DeepEP's clients import, and this package's module for each.
_MODULES = {
    "deep_ep": sys.modules[__name__],
    "deep_ep.buffer": buffer,
    "deep_ep.buffers": buffers,
    "deep_ep.buffers.legacy": buffers.legacy,
    "deep_ep.hybrid_ep_buffer": hybrid_ep_buffer,
    "deep_ep.utils": utils,
    "deep_ep.utils.event": event,
}


def register() -> None:
    """Make ``import deep_ep`` (and its submodules) give this package, in this process.

    Idempotent. RuntimeError if another ``deep_ep`` (DeepEP itself) is imported already: the
    modules that imported it hold its classes, so register before anything imports deep_ep.
    """
    imported = {
        name: module
        for name, module in sys.modules.items()
        if (name == "deep_ep" or name.startswith("deep_ep.")) and module is not _MODULES.get(name)
    }
    if imported:
        where = getattr(imported.get("deep_ep"), "__file__", None) or sorted(imported)
        raise RuntimeError(
            f"another deep_ep is imported already ({where}): call "
            "hybrid_ep_triton.deep_ep.register() before anything imports deep_ep"
        )
    sys.modules.update(_MODULES)
