"""Kernel launches that cost little host time.

``kernel[grid](...)`` derives the kernel's specialisation from every argument on every call
(Triton's binder, cache key, launch metadata), then its launcher reads each tensor's address
and checks it with the driver. For this library's kernels, 30-50 arguments, that is 50-60 µs
of host time per launch on an H200 machine's host, against 13 µs for the compiled kernel's
launcher alone: more than a small dispatch takes on the GPU.

A KernelLauncher binds the arguments that stay the same for a Buffer once. Each call passes the
others in two groups: ``specialized``, whose Triton specialisation may differ between calls
(tensors the caller passed in, integers, and constexprs, which are keyed by value), and
``aligned``, tensors or TensorViews this library allocated (16-byte aligned, with the same dtype
every call, so the same specialisation). The first call of each specialisation goes through
Triton, which compiles or loads the kernel; later ones call its compiled launcher
(``CompiledKernel[grid]``) with addresses as integers. Under the interpreter
(TRITON_INTERPRET=1) every call goes through Triton.

Even then, naming every argument per call costs more host time than the compiled launcher
(10-14 µs per launch for the bookkeeping here, and as much again for building the arguments at
the call sites). So a launch also returns a Relaunch: the same launch again, given only the
values of the arguments that a repeated call changes (``changing``, positionally, then the new
address of the tensor its TensorViews were views of), checked against the specialisation. A
Relaunch launches through the driver (``cuLaunchKernel``) from a parameter array it keeps, where
the kernel needs nothing that only Triton's launcher does, instead of Triton's compiled
launcher, which parses every argument again on every call: 6-10 µs per launch of these kernels
instead of 8-16, of which the driver call itself is most.

With HEP_RECORD_BUILDS set to a directory, each process records the specialisations of this
library's kernels that it builds (``record_builds``), for ``tools.prebuild`` to compile ahead of
a later run, all at once.
"""

import functools
import os
import struct
from pathlib import Path
from time import perf_counter

import numpy as np
import torch
import triton
from triton import knobs
from triton.compiler import CompiledKernel
from triton.runtime import JITFunction

_INT32 = range(-(2**31), 2**31)

RECORD_BUILDS = "HEP_RECORD_BUILDS"  # environment: the directory that record_builds writes to


@functools.cache
def record_builds(directory: str) -> None:
    """From now on, append each specialisation of this library's kernels that this process
    builds (compiles, or loads from Triton's cache: its first launch in the process) to
    ``directory``/builds-<pid>.jsonl, a line each in Triton's serialised form (what
    ``JITFunction.preload`` takes), for ``tools.prebuild``. Triton's jit_cache_hook, which
    this takes, still calls a hook that was set before."""
    path = Path(directory) / f"builds-{os.getpid()}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    previous = knobs.runtime.jit_cache_hook
    package = __name__.split(".")[0]

    def hook(*, fn, compile, **kwargs):
        if fn.module.split(".")[0] == package:
            with path.open("a") as records:
                records.write(compile["specialization_data"] + "\n")
        return previous(fn=fn, compile=compile, **kwargs) if previous else None

    knobs.runtime.jit_cache_hook = hook


if os.environ.get(RECORD_BUILDS):
    record_builds(os.environ[RECORD_BUILDS])


class TensorView:
    """A strided view of ``base`` (shape, strides, offset in elements) that a launch passes by
    its address, made into a tensor only where Triton needs one (the first launch of a
    specialisation, the interpreter): a view costs microseconds of host time."""

    __slots__ = ("base", "shape", "strides", "offset", "address")

    def __init__(self, base: torch.Tensor, shape: tuple, strides: tuple, offset: int):
        self.base, self.shape, self.strides, self.offset = base, shape, strides, offset
        self.address = base.data_ptr() + offset * base.element_size()

    def tensor(self) -> torch.Tensor:
        offset = self.base.storage_offset() + self.offset  # as_strided's is the storage's
        return self.base.as_strided(self.shape, self.strides, offset)


def _specialization(value) -> object:
    """What Triton specialises a kernel on, for one argument that is not a constexpr: a
    tensor's dtype and whether its address is a multiple of 16; an integer's being 1, a
    multiple of 16, in int32 range or beyond int64's; any other value itself."""
    if isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() % 16 == 0
    if type(value) is int:
        return _int_specialization(value)
    return value


def _int_specialization(value: int) -> tuple:
    return value == 1, value % 16 == 0, value in _INT32, value < 2**63


class KernelLauncher:
    """Launches of one ``@triton.jit`` kernel for one Buffer.

    Args:
        kernel: the JITFunction.
        on_compile: called with each CompiledKernel before its first launch (NVSHMEM's module
            initialisation), or None.
        constants: the kernel's arguments that stay the same for the Buffer, by parameter name,
            and its launch options (num_warps, maxnreg, extern_libs, ...).
    """

    def __init__(self, kernel, on_compile=None, **constants):
        self._kernel = kernel
        self._on_compile = on_compile
        names = kernel.arg_names
        self._index = {name: i for i, name in enumerate(names)}
        self._options = {k: v for k, v in constants.items() if k not in self._index}
        self._args = [constants.get(name) for name in names]
        self._bound = {name for name in names if name in constants}
        # The compiled launcher takes integers for pointers (and skips checking them).
        self._addresses = [v.data_ptr() if isinstance(v, torch.Tensor) else v for v in self._args]
        # By specialisation key: the compiled kernel, its launcher for the key's grid, and its
        # parameters for a driver launch (None: Relaunches take the launcher).
        self._specialisations: dict[tuple, tuple] = {}
        # Host seconds in the first launches of specialisations, which compile them (or load
        # them from Triton's cache): what tells a slow call that compiled from one that waited.
        self.build_seconds = 0.0
        # Under the interpreter kernels are InterpretedFunctions, launched through Triton only.
        self._compiled = isinstance(kernel, JITFunction)
        # A constexpr is in the key by its value; an integer Triton does not specialise on (the
        # kernel's do_not_specialize) by its type alone (int32 or not), and a Relaunch does not
        # check it (the kernels' are counts, in int32 range).
        self._constexprs = (
            {p.name for p in kernel.params if p.is_constexpr} if self._compiled else ()
        )
        self._unspecialized = (
            {p.name for p in kernel.params if p.do_not_specialize} if self._compiled else ()
        )

    def __call__(
        self,
        grid: tuple[int, ...],
        specialized: dict,
        aligned: dict,
        changing: tuple = (),
        views_of: torch.Tensor | None = None,
    ) -> "Relaunch | None":
        """Launch on the current device's current stream. ``specialized`` and ``aligned`` (its
        values tensors or TensorViews) hold the arguments not bound at construction, by name,
        the same names in every call. Returns the Relaunch of this launch for the arguments
        named in ``changing`` (never a constexpr) and the TensorViews of ``views_of``, or None
        under the interpreter."""
        constexprs, unspecialized = self._constexprs, self._unspecialized
        if changing and any(name in constexprs for name in changing):
            raise TypeError(f"{self._kernel.__name__}: a constexpr cannot change: {changing}")
        if not self._compiled:
            self._through_triton(grid, specialized, aligned)
            return None
        driver = triton.runtime.driver.active
        device = driver.get_current_device()
        key = (
            device,
            grid,
            *[
                value
                if name in constexprs
                else value in _INT32
                if name in unspecialized
                else _specialization(value)
                for name, value in specialized.items()
            ],
        )
        entry = self._specialisations.get(key)
        through_triton = entry is None  # which also launched it
        if through_triton:
            started = perf_counter()
            compiled = self._through_triton(grid, specialized, aligned)
            self.build_seconds += perf_counter() - started
            if compiled is None:
                return None
            runner, parameters = compiled[(*grid, 1, 1)[:3]], _driver_parameters(compiled)
            entry = self._specialisations[key] = compiled, runner, parameters
        compiled, runner, parameters = entry
        args, index, tensor = list(self._addresses), self._index, torch.Tensor
        for name, value in specialized.items():
            args[index[name]] = value.data_ptr() if isinstance(value, tensor) else value
        for name, value in aligned.items():
            args[index[name]] = value.data_ptr() if isinstance(value, tensor) else value.address
        if not through_triton:
            runner(*args, stream=driver.get_current_stream(device))
        checked = {
            i: _specialization(specialized[name])
            for i, name in enumerate(changing)
            if name in specialized and name not in unspecialized
        }
        views = [
            (index[name], value.address - views_of.data_ptr())
            for name, value in aligned.items()
            if isinstance(value, TensorView) and value.base is views_of
        ]
        if parameters is None:
            launch = _TritonLaunch(runner, args, device)
        else:
            launch = _DriverLaunch(compiled, grid, args, parameters, device)
        return Relaunch(launch, [index[name] for name in changing], checked, views)

    @property
    def builds(self) -> int:
        """Specialisations launched so far, each a compile unless Triton's cache has it (0 under
        the interpreter, which compiles nothing). A new grid is a new launcher entry but not a
        new build: the keys are counted without it."""
        return len({(device, *spec) for device, _grid, *spec in self._specialisations})

    def _through_triton(self, grid, specialized: dict, aligned: dict):
        """Launch through Triton; returns the compiled kernel (None where Triton returns
        none)."""
        given = {**specialized, **aligned}
        missing = [n for n in self._index if n not in given and n not in self._bound]
        if missing:
            raise TypeError(f"{self._kernel.__name__}: no value for {missing}")
        args = list(self._args)
        for name, value in given.items():
            args[self._index[name]] = value.tensor() if isinstance(value, TensorView) else value
        if self._on_compile is None or not self._compiled:
            compiled = self._kernel[grid](*args, **self._options)
            return compiled if isinstance(compiled, CompiledKernel) else None
        # Compile without launching, so that the module is initialised before it first runs.
        compiled = self._kernel.warmup(*args, grid=grid, **self._options)
        compiled._init_handles()
        self._on_compile(compiled)
        driver = triton.runtime.driver.active
        compiled[(*grid, 1, 1)[:3]](
            *args, stream=driver.get_current_stream(driver.get_current_device())
        )
        return compiled


class Relaunch:
    """A launch of one compiled specialisation, to be made again with new values of some of
    its arguments (the others as in the launch it came from).

    ``relaunch(*values, base)`` takes the values of the ``changing`` arguments in order
    (tensors or integers: addresses of this library's allocations as integers, unchecked), then
    the address of the tensor the launch's TensorViews were views of (``views_of``), whose
    views it moves with it. Values of arguments that Triton specialises on (the launch's
    ``specialized`` ones) are checked; where one would take another specialisation nothing is
    launched and it returns False (the caller then launches through its KernelLauncher, which
    finds or compiles that one, and drops this Relaunch, whose arguments are then partly
    updated).
    """

    __slots__ = ("_launch", "_args", "_values", "_views")

    def __init__(self, launch, slots: list[int], checked: dict[int, object], views: list):
        self._launch, self._args = launch, launch.args
        # (argument index, specialisation the value must keep or None) of each value in turn:
        # one pass over the values per launch, each tensor's address read once, is most of a
        # relaunch's host time.
        self._values = [(slot, checked.get(position)) for position, slot in enumerate(slots)]
        self._views = views  # (argument index, byte offset from the base)

    def __call__(self, *values) -> bool:
        args = self._args
        for (slot, expected), value in zip(self._values, values, strict=False):  # base last
            if type(value) is int:
                if expected is not None and _int_specialization(value) != expected:
                    return False
                args[slot] = value
            else:
                address = value.data_ptr()
                # _specialization's rule for a tensor, inline: a call per value costs host time.
                if expected is not None and (value.dtype, address % 16 == 0) != expected:
                    return False
                args[slot] = address
        base = values[-1]
        for slot, offset in self._views:
            args[slot] = base + offset
        self._launch()
        return True


class _TritonLaunch:
    """A launch through the compiled kernel's launcher: ``args`` (a list, by argument index,
    pointers as addresses) as its arguments."""

    __slots__ = ("args", "_runner", "_stream", "_device")

    def __init__(self, runner, args: list, device):
        self.args, self._runner, self._device = args, runner, device
        self._stream = triton.runtime.driver.active.get_current_stream

    def __call__(self) -> None:
        self._runner(*self.args, stream=self._stream(self._device))


# Parameter types a driver launch passes: pointers ("*<dtype>"), these, and fp32.
_INTEGER_TYPES = frozenset({"i1", "i8", "i16", "i32", "i64", "u1", "u8", "u16", "u32", "u64"})


class _DriverLaunch:
    """A launch through the driver, ``cuLaunchKernel``, of a parameter array built once.

    ``args`` holds every argument's value by argument index as int64 (pointers as addresses;
    the driver copies each parameter's size from its slot, the low bytes on little-endian
    hosts; fp32 as its bits; constexprs' slots unused). The array handed to the driver points
    at the slots of the kernel's parameters, then twice at a zero: the global and profile
    scratch pointers Triton appends to every kernel's parameters since 3.3 and 3.5 (the driver
    reads as many parameters as the kernel has).
    """

    __slots__ = ("args", "_params", "_call", "_stream", "_device", "_name", "_success")
    # (_params is kept for its memory: _call holds its address.)

    def __init__(self, compiled, grid: tuple, args: list, parameters: list, device):
        cuda = _driver_api()
        values = np.zeros(len(args) + 1, dtype=np.int64)  # the last stays zero
        for i, kind in parameters:
            values[i] = _fp32_bits(args[i]) if kind == "fp32" else args[i]
        base = values.ctypes.data
        null = base + 8 * len(args)
        self._params = np.array([base + 8 * i for i, _ in parameters] + [null, null], np.uint64)
        self.args = memoryview(values)  # the same memory: its items are set faster than numpy's
        meta = compiled.metadata
        self._call = (
            cuda.cuLaunchKernel,
            compiled.function,
            *(*grid, 1, 1)[:3],
            32 * meta.num_warps,
            1,
            1,
            meta.shared,
            self._params.ctypes.data,
        )
        self._device, self._name = device, compiled.name
        self._stream = triton.runtime.driver.active.get_current_stream
        self._success = cuda.CUresult.CUDA_SUCCESS

    def __call__(self) -> None:
        launch, function, gx, gy, gz, threads, by, bz, shared, params = self._call
        stream = self._stream(self._device)
        (error,) = launch(function, gx, gy, gz, threads, by, bz, shared, stream, params, 0)
        if error != self._success:
            raise RuntimeError(f"cuLaunchKernel of {self._name} failed: {error}")


@functools.cache
def _driver_api():
    """cuda-python's driver module, or None where it cannot reach the driver (it is not
    installed, or it was built for a newer CUDA than the driver's): then Relaunches take
    Triton's launcher."""
    try:
        from cuda.bindings import driver
    except ImportError:
        return None
    try:
        error, _ = driver.cuDriverGetVersion()
    except Exception:  # the driver library was not found or lacks the entry point
        return None
    return driver if error == driver.CUresult.CUDA_SUCCESS else None


def _fp32_bits(value: float) -> int:
    return struct.unpack("<i", struct.pack("<f", value))[0]


def _driver_parameters(compiled) -> list[tuple[int, str]] | None:
    """The kernel parameters of ``compiled`` for a driver launch: (argument index, type) of
    each argument that is not a constexpr, in order; or None where the launch needs what only
    Triton's launcher does: launch attributes (clusters, cooperative grids, programmatic
    dependent launch), scratch memory, tensor descriptors, parameters of other types, launch
    hooks (a profiler's: they are looked at when the kernel is first launched), or a driver
    that cuda-python cannot reach."""
    meta = compiled.metadata
    hook = triton.knobs.runtime.launch_enter_hook
    if (
        getattr(meta, "num_ctas", 1) != 1
        or getattr(meta, "launch_cooperative_grid", False)
        or getattr(meta, "launch_pdl", False)
        or getattr(meta, "global_scratch_size", 0)
        or getattr(meta, "profile_scratch_size", 0)
        or getattr(meta, "tensordesc_meta", None)
        or (hook is not None and getattr(hook, "calls", True))  # a HookChain since 3.7
        or _driver_api() is None
    ):
        return None
    src = compiled.src
    names = src.fn.arg_names
    # Triton keys constants by argument name or by index path; older releases also list
    # specialised arguments there that the signature does not mark constexpr.
    constants = {
        names.index(k) if isinstance(k, str) else k[0] for k in getattr(src, "constants", {})
    }
    if len(src.signature) != len(names):
        return None
    parameters = []
    for i, kind in enumerate(src.signature.values()):
        if kind == "constexpr" or i in constants:
            continue
        if not (kind.startswith("*") or kind in _INTEGER_TYPES or kind == "fp32"):
            return None
        parameters.append((i, kind))
    return parameters
