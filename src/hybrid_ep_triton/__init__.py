"""hybrid_ep_triton: expert-parallel dispatch and combine for mixture-of-experts, in Triton.

The public API is ``Buffer``; ``hybrid_ep_triton.reference`` is the plain-torch reference
dispatcher. Importing the package compiles nothing: kernels JIT-compile on first use.
"""

from .buffer import Buffer

__all__ = ["Buffer"]
__version__ = "0.1.0"
