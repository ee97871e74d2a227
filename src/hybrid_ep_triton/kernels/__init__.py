"""Triton kernels only: ``@triton.jit`` functions, no torch calls.

primitives: peer pointers, release signals, bounded acquire waits (used by all the others);
route: the dispatch layout; dispatch: the token move and expansion; combine: the reduction back;
quantize: the FP8, MXFP8 and NVFP4 quantizers; control: the control block's words and the stage
codes by name; work: column parts and work queues that dispatch and combine share;
low_latency: the low-latency mode's dispatch and combine (decode).

The low-latency kernels' meta-parameters: W ranks, L local experts, B = E - L receive blocks,
M the Buffer's low_latency_tokens, S column slices of a row (a program and a flag each), K
slots of a token (K_P2 its power of 2), SCAN routing entries scanned at a time, ROWS rows and
BLOCK_H columns of a tile, STAGES tiles in flight (tl.range's num_stages), PARTS column parts of
a slice that combine's receive role sums in programs of their own, GROUPS 128-channel groups a
quantizing program takes (QC_P2: the power of 2 of a row's chunks of them, G_P2 of its groups),
ROW_BYTES a staged dispatch row (header and payload), FP8 / ROUND / UE8M0 the row format,
ALIGNED rows 16-byte aligned, HAS_STATS statistics given, ZERO_COPY combine's x is its buffer,
NODES nodes of the group, SEND / RECEIVE which halves of a call the launch runs.

Importing the package with Triton before 3.8 settles the kernels' Triton cache keys
(``_settle_cache_keys``), so that every process finds the builds that another compiled; under
the interpreter with Triton before 3.7 it takes an interpreted scalar as an index as Triton 3.7
does (``_index_scalars_as_triton_3_7``), which NumPy 2.4 and later need.
"""

import os
import sys

import triton
from triton.runtime.jit import JITCallable

from . import combine, dispatch, quantize, route  # noqa: F401  (every kernel, for the keys)

# A settled key takes at most as many passes as calls nest; a bound against a loop that never
# settles, which Triton's key (a hash of sources and constants) should not allow.
_MAX_KEY_PASSES = 16


def _settle_cache_keys() -> None:
    """Compute the cache key of every jit function of these kernels and of triton.language
    until none changes. Before Triton 3.8, a function's key takes in the constexpr globals its
    callees read only where their keys were computed before its own, so the same kernel got a
    different key (and missed Triton's cache) in a process that had compiled another kernel
    first: on sm_90 with Triton 3.6, 29 of 64 layout builds of the shared suite were keyed apart
    in a process that had compiled an across-nodes dispatch first, with identical machine code.
    Settled keys are those that Triton 3.8 and later compute at once."""
    functions = {
        id(value): value
        for name, module in list(sys.modules.items())
        if name.startswith(("triton.language", __name__))
        for value in vars(module).values()
        if isinstance(value, JITCallable)
    }.values()
    keys = None
    for _ in range(_MAX_KEY_PASSES):
        for function in functions:
            function.hash = None
        previous, keys = keys, [function.cache_key for function in functions]
        if keys == previous:
            return
    raise RuntimeError(f"Triton cache keys still change after {_MAX_KEY_PASSES} passes")


def _index_scalars_as_triton_3_7() -> None:
    """Triton's interpreter holds a scalar as a NumPy array of one element; before Triton 3.7 it
    made one a Python index with ``int(array)``, which NumPy 2.4 refuses for arrays that are not
    0-dimensional, so that a loop ``range(0, n, BLOCK)`` over an integer argument raised
    "only 0-dimensional arrays can be converted to Python scalars" (triton-lang/triton#9171;
    found with Triton 3.6 and NumPy 2.4 on the device image, 2026-12-04). Triton 3.7 squeezes
    the array first: this does the same where the interpreter marks tl.tensor's methods."""
    from triton.runtime import interpreter

    mark_tensor = interpreter._patch_lang_tensor

    def mark_tensor_with_index(tensor, scope):
        mark_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = mark_tensor_with_index


_TRITON = tuple(int(part) for part in triton.__version__.split(".")[:2])
if os.environ.get("TRITON_INTERPRET") == "1" and _TRITON < (3, 7):
    _index_scalars_as_triton_3_7()

# Triton 3.8 and later key a function after its callees' keys (the settled keys) at once.
if _TRITON < (3, 8):
    _settle_cache_keys()
