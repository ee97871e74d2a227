"""What this library needs of Triton beyond its API, by version, applied once the kernels are
imported (``apply``, which ``ops`` calls on import):

- before Triton 3.8, the kernels' Triton cache keys are settled (``_settle_cache_keys``), so
  that every process finds the builds that another compiled;
- under the interpreter before Triton 3.7, an interpreted scalar is taken as an index as Triton
  3.7 does (``_index_scalars_as_triton_3_7``), which NumPy 2.4 and later need.
"""

import importlib
import os
import sys

import triton
from triton.runtime.jit import JITCallable

# Every module of jit functions of this library, whose keys are settled together.
_KERNEL_MODULES = (
    "combine",
    "dispatch",
    "experts",
    "low_latency",
    "primitives",
    "quantize",
    "route",
    "token_counts",
    "work",
)
_KERNELS = __name__.rsplit(".", 2)[0] + ".kernels"

# A settled key takes at most as many passes as calls nest; a bound against a loop that never
# settles, which Triton's key (a hash of sources and constants) should not allow.
_MAX_KEY_PASSES = 16


def _settle_cache_keys() -> None:
    """Compute the cache key of every jit function of these kernels and of triton.language
    until none changes. Before Triton 3.8, a function's key takes in the constexpr globals its
    callees read only where their keys were computed before its own, so the same kernel got a
    different key (and missed Triton's cache, with identical machine code) in a process that
    had compiled another kernel first. Settled keys are those that Triton 3.8 and later compute
    at once."""
    functions = {
        id(value): value
        for name, module in list(sys.modules.items())
        if name.startswith(("triton.language", _KERNELS))
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
    "only 0-dimensional arrays can be converted to Python scalars" (triton-lang/triton#9171).
    Triton 3.7 squeezes the array first: this does the same where the interpreter marks
    tl.tensor's methods."""
    from triton.runtime import interpreter

    mark_tensor = interpreter._patch_lang_tensor

    def mark_tensor_with_index(tensor, scope):
        mark_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = mark_tensor_with_index


_TRITON = tuple(int(part) for part in triton.__version__.split(".")[:2])


def apply() -> None:
    """Import every kernel module, then apply what this Triton needs; once a process (``ops``
    calls it on import)."""
    for module in _KERNEL_MODULES:
        importlib.import_module(f"{_KERNELS}.{module}")
    if os.environ.get("TRITON_INTERPRET") == "1" and _TRITON < (3, 7):
        _index_scalars_as_triton_3_7()
    # Triton 3.8 and later key a function after its callees' keys (the settled keys) at once.
    if _TRITON < (3, 8):
        _settle_cache_keys()
