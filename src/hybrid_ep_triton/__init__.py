"""hybrid_ep_triton: expert-parallel dispatch and combine for mixture-of-experts, in Triton.

The public API is ``Buffer``; ``hybrid_ep_triton.reference`` is the plain-torch reference
dispatcher. Importing the package imports neither torch nor triton: ``Buffer`` is imported on
first use (so that ``hybrid-ep --help`` answers at once), and kernels JIT-compile on first use.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .buffer import Buffer

__all__ = ["Buffer"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "Buffer":
        from .buffer import Buffer

        return Buffer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
