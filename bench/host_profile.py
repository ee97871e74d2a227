"""Where the host time of each eager call goes, per call kind, on one GPU:

    python3 bench/host_profile.py [--shapes S1,S2] [--iters 200] [--sms 8]

For each shape and layout (expert rows, token rows), each call kind (exact-mode dispatch,
max_recv_tokens dispatch, cached dispatch, combine) is called back to back as a user's loop
calls it, with events around each call on the calling stream as the benchmark times it. Then
the same calls run with the library's steps wrapped in timers (perf_counter_ns, a stack so that
each step's time excludes the steps it calls), and the median µs per call of each step is
printed: our Python (checks, handle, launch arguments), torch's allocations, the wait for the
row count, Triton's compiled launcher. The wrappers add about half a µs per wrapped step, so
the total of the steps exceeds the unwrapped call's host time by that much.

Last, the launch alone: each kind of data move's last launch replayed, and for kernels of 1 to
64 integer arguments (one store each) Triton's compiled launcher beside the driver launch of a
Relaunch (ops/launch.py), made through cuda-python and through ctypes, and the torch calls an
eager call makes (allocations, views, two events).
"""

import argparse
import functools
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
import triton

import hybrid_ep_triton as hep
from hybrid_ep_triton import buffer as buffer_module
from hybrid_ep_triton.ops import dispatch, launch

try:
    from hybrid_ep_triton.ops import operators as library
except ImportError:  # (trees before ops/operators.py, which eager_ab.py also times)
    from hybrid_ep_triton.ops import library
from hybrid_ep_triton.tools.bench import SHAPES, combine_weights, inputs, median_us
from hybrid_ep_triton.tools.launcher import run_ranks


class StepTimer:
    """Exclusive host ns per named step for the current call; ``wrap`` installs a timed
    stand-in for ``owner.name`` (``wrap_entry`` for a dict's entry) and ``restore`` puts every
    original back."""

    def __init__(self):
        self.stack: list[int] = []
        self.call: dict[str, int] = defaultdict(int)
        self.saved: list[tuple[object, str, object]] = []

    def timed(self, label: str, fn):
        @functools.wraps(fn)
        def stand_in(*args, **kwargs):
            self.stack.append(0)
            t0 = time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter_ns() - t0
                inner = self.stack.pop()
                self.call[label] += elapsed - inner
                if self.stack:
                    self.stack[-1] += elapsed

        return stand_in

    def wrap(self, owner, name: str, label: str | None = None) -> None:
        original = getattr(owner, name)
        self.saved.append((owner, name, original))
        setattr(owner, name, self.timed(label or name, original))

    def wrap_entry(self, table: dict, key, label: str) -> None:
        """Time the launcher of a KernelLauncher's entry (compiled, launcher, parameters)."""
        compiled, runner, parameters = entry = table[key]
        self.saved.append((table, key, entry))
        table[key] = compiled, self.timed(label, runner), parameters

    def restore(self) -> None:
        for owner, name, original in reversed(self.saved):
            if isinstance(owner, dict):
                owner[name] = original
            else:
                setattr(owner, name, original)
        self.saved.clear()


def _wrap_library(timer: StepTimer, buf: hep.Buffer) -> None:
    """Timers around the steps of an eager call, outermost first."""
    rt = buf._rt
    for name in ("dispatch", "combine", "_check_usable", "_check_tokens", "_check_routing",
                 "_check_handle", "_check_event", "_launch", "_track_overflow"):  # fmt: skip
        if hasattr(hep.Buffer, name):
            timer.wrap(hep.Buffer, name, f"Buffer.{name}")
    for module, names in ((buffer_module, ("check_tensor", "check_dispatch_inputs",
                                           "check_combine_inputs")),
                          (library, ("run_any_dispatch",))):  # fmt: skip
        for name in names:
            if hasattr(module, name):
                timer.wrap(module, name)
    for name in ("compute_layout", "reduce_tokens"):
        timer.wrap(library, name)
    # (Looked up here: eager_ab.py imports this module with older trees too.)
    timer.wrap(dispatch.PreparedMove, "__init__", "prepare_move")
    for name in ("launch_awaiting_outputs", "deliver"):
        timer.wrap(dispatch.PreparedMove, name, f"PreparedMove.{name}")
    for name in ("_dispatch_with_handle", "_exact_move", "run_dispatch"):
        if hasattr(library, name):
            timer.wrap(library, name)
    for name in ("make_handle", "write_host_record"):
        if hasattr(dispatch, name):
            timer.wrap(dispatch, name)
    for name in ("_allocate", "_arguments", "_launch"):
        if hasattr(dispatch.PreparedMove, name):
            timer.wrap(dispatch.PreparedMove, name, f"PreparedMove.{name}")
    timer.wrap(torch.cuda, "is_current_stream_capturing")
    if hasattr(rt, "read_report"):  # trees before ops/status.py: callbacks of the runtime
        timer.wrap(rt, "read_report", "read_report (wait for the row count)")
        timer.wrap(rt, "check_status")
    else:
        from hybrid_ep_triton.ops import status

        timer.wrap(status, "read_report", "read_report (wait for the row count)")
        timer.wrap(status, "check_after_launch")
    timer.wrap(launch.KernelLauncher, "__call__", "KernelLauncher (key, arguments)")
    timer.wrap(launch.Relaunch, "__call__", "Relaunch (checks, arguments)")
    for launcher in rt.launchers.values():
        for key in list(launcher._specialisations):
            timer.wrap_entry(launcher._specialisations, key, "Triton compiled launcher")
    for relaunch in rt.relaunches.values():
        if relaunch is not None:
            timer.wrap(relaunch, "_launch", _launch_label(relaunch))
    timer.wrap(torch, "empty", "torch.empty")


def _launch_label(relaunch: launch.Relaunch) -> str:
    through_driver = isinstance(relaunch._launch, launch._DriverLaunch)
    return "kernel launch (cuLaunchKernel)" if through_driver else "Triton compiled launcher"


def _profile(fn, args_list, iters: int, timer: StepTimer) -> dict[str, float]:
    """Median exclusive µs per call of each step over ``iters`` back-to-back calls (events
    around each, as the benchmark)."""
    per_call = defaultdict(list)
    for i in range(iters):
        timer.call = defaultdict(int)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter_ns()
        fn(*args_list[i % len(args_list)])
        total = time.perf_counter_ns() - t0
        end.record()
        for label, ns in timer.call.items():
            per_call[label].append(ns / 1e3)
        per_call["(whole call, wrapped)"].append(total / 1e3)
    torch.cuda.synchronize()
    return {label: statistics.median(us) for label, us in per_call.items()}


def eager_calls(buf: hep.Buffer, sets: list) -> dict:
    """{call kind: (fn, argument sets)} of ``buf`` on the input sets ``sets`` (x, topk_idx,
    topk_weights): exact-mode, max_recv_tokens and cached dispatches, and combines."""
    exact = [buf.dispatch(*s) for s in sets]
    rows = max(out[-1].num_recv_rows for out in exact)
    cached = [(s[0], s[2], out[-1]) for s, out in zip(sets, exact, strict=True)]
    combines = [(torch.randn_like(out[0]), out[-1], combine_weights(buf, out)) for out in exact]
    return {
        # Lambdas, so that each call finds the wrapped methods.
        "exact dispatch": (lambda x, i, w: buf.dispatch(x, i, w), sets),
        "max_recv dispatch": (
            lambda x, i, w: buf.dispatch(x, i, w, max_recv_tokens=rows * 11 // 10),
            sets,
        ),
        "cached dispatch": (lambda x, w, h: buf.dispatch(x, topk_weights=w, handle=h), cached),
        "combine": (lambda y, h, w: buf.combine(y, h, weights=w), combines),
    }


def _replays(buf: hep.Buffer, calls: dict, iters: int, what: str) -> list[str]:
    """Host µs of the compiled launcher alone with the arguments of a cached dispatch and a
    combine: each call made once more (its outputs kept), then its launch replayed, which is
    the same call again."""
    lines = []
    for name, kind in (("cached dispatch", "move"), ("combine", "combine")):
        fn, args_list = calls[name]
        kept = fn(*args_list[0])  # noqa: F841 - the replayed launch writes into its outputs
        key = next(k for k in buf._rt.relaunches if k[0] == kind and (kind != "move" or k[3]))
        relaunch = buf._rt.relaunches[key]
        us = _host_median(relaunch._launch, iters)
        torch.cuda.synchronize()
        lines.append(f"{what}, {name}: its launch replayed ({len(relaunch._args)} arguments): "
                     f"{us:.1f} µs, {_launch_label(relaunch)}")  # fmt: skip
    return lines


def _launcher_costs(iters: int) -> list[str]:
    """Host µs of Triton's compiled launcher by the number of integer arguments, and of the
    torch calls around a launch."""
    lines = []
    folder = Path(tempfile.mkdtemp())
    for count in (1, 16, 32, 64):
        params = ", ".join(f"a{i}" for i in range(count))
        body = " + ".join(f"a{i}" for i in range(count))
        source = f"import triton\n\n\n@triton.jit\ndef store_sum(out_ptr, {params}):\n"
        source += f"    out_ptr.store({body})\n"
        path = folder / f"args{count}.py"
        path.write_text(source)
        sys.path.insert(0, str(folder))
        kernel = __import__(f"args{count}").store_sum
        sys.path.pop(0)
        out = torch.zeros(1, dtype=torch.int64, device="cuda")
        args = [out, *range(2, count + 2)]
        compiled = kernel[(1,)](*args)
        runner = compiled[(1, 1, 1)]
        stream = triton.runtime.driver.active.get_current_stream(torch.cuda.current_device())
        int_args = [out.data_ptr(), *args[1:]]
        jit = _host_median(functools.partial(kernel[(1,)], *args), iters)
        raw = _host_median(functools.partial(runner, *int_args, stream=stream), iters)
        device = torch.cuda.current_device()
        parameters = launch._driver_parameters(compiled)
        driver_launch = launch._DriverLaunch(compiled, (1,), int_args, parameters, device)
        direct = _host_median(driver_launch, iters)
        through_ctypes = _host_median(_ctypes_launch(driver_launch, device), iters)
        torch.cuda.synchronize()
        assert out.item() == sum(args[1:]), "the driver launch stored a wrong sum"
        lines.append(
            f"launch of a kernel with {count} int args: {jit:.1f} µs through kernel[grid], "
            f"{raw:.1f} µs by its compiled launcher (addresses as ints), {direct:.1f} µs by "
            f"cuLaunchKernel from a kept parameter array ({through_ctypes:.1f} µs calling it "
            "through ctypes instead of cuda-python)"
        )
    lines += _torch_call_costs(iters)
    events = _host_median(
        lambda: [torch.cuda.Event(enable_timing=True).record() for _ in range(2)], iters
    )
    lines.append(f"{host_speed(iters)}; two events made and recorded: {events:.1f} µs")
    return lines


def _ctypes_launch(driver_launch: launch._DriverLaunch, device: int):
    """``driver_launch`` made through ctypes (libcuda.so.1, argument types set once) instead of
    cuda-python's binding, the same parameter array: the binding's share of a launch."""
    import ctypes

    cu_launch = ctypes.CDLL("libcuda.so.1").cuLaunchKernel
    cu_launch.argtypes = [ctypes.c_void_p, *[ctypes.c_uint] * 7, ctypes.c_void_p,
                          ctypes.c_void_p, ctypes.c_void_p]  # fmt: skip
    cu_launch.restype = ctypes.c_int
    _, function, gx, gy, gz, threads, by, bz, shared, params = driver_launch._call
    stream = functools.partial(triton.runtime.driver.active.get_current_stream, device)

    def through_ctypes():
        error = cu_launch(function, gx, gy, gz, threads, by, bz, shared, stream(), params, None)
        if error:
            raise RuntimeError(f"cuLaunchKernel through ctypes failed: {error}")

    return through_ctypes


def _torch_call_costs(iters: int) -> list[str]:
    """Host µs of the small torch calls on an eager dispatch's path."""
    cuda = torch.device("cuda", torch.cuda.current_device())
    t = torch.empty(1024, dtype=torch.int64, device=cuda)
    calls = {
        "torch.empty(1000, int32)": lambda: torch.empty(1000, dtype=torch.int32, device=cuda),
        "torch.empty(128, 8, float32)": lambda: torch.empty(128, 8, device=cuda),
        "torch.cuda.is_current_stream_capturing()": torch.cuda.is_current_stream_capturing,
        "t.data_ptr()": t.data_ptr,
        "t[4:]": lambda: t[4:],
        "t.view(torch.int32)": lambda: t.view(torch.int32),
        "t.contiguous()": t.contiguous,
        "torch.is_grad_enabled()": torch.is_grad_enabled,
        "torch.compiler.is_compiling()": torch.compiler.is_compiling,
    }
    return [f"{name}: {_host_median(fn, iters):.2f} µs" for name, fn in calls.items()]


def host_speed(iters: int = 2000) -> str:
    """This host's speed now, for runs to be compared: medians of µs of an empty Python call
    and of torch.empty [128, 7168] bf16 on the GPU (the host's speed moves by about 1.5x between
    and within runs on the lent machine)."""
    call = _host_median(lambda: None, iters)
    empty = _host_median(lambda: torch.empty(128, 7168, dtype=torch.bfloat16, device="cuda"), iters)
    return f"host speed: an empty Python call {call:.3f} µs, torch.empty {empty:.2f} µs"


def _host_median(fn, iters: int) -> float:
    for _ in range(10):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter_ns()
        fn()
        times.append((time.perf_counter_ns() - t0) / 1e3)
    return statistics.median(times)


def _rank(rank: int, world: int, args) -> list[str]:
    lines = []
    for name in filter(None, args.shapes.split(",")):
        shape = SHAPES[name]
        sets = [inputs(shape, rank, seed) for seed in range(4)]
        for expand in (True, False):
            buf = hep.Buffer(
                None, hidden_size=shape.hidden, max_tokens_per_rank=shape.tokens,
                num_experts=shape.experts, num_sms=args.sms, expand=expand,
            )  # fmt: skip
            rows = "expert" if expand else "token"
            calls = eager_calls(buf, sets)
            for what, (fn, args_list) in calls.items():
                device_us, host_us = median_us(fn, args_list, args.warmup, args.iters)
                timer = StepTimer()
                _wrap_library(timer, buf)
                try:
                    steps = _profile(fn, args_list, args.iters, timer)
                finally:
                    timer.restore()
                lines.append(
                    f"## {name} {rows} rows, {what}: {device_us:.1f} µs device, {host_us:.1f} µs "
                    "host (unwrapped, events around each call)"
                )
                for label, us in sorted(steps.items(), key=lambda item: -item[1]):
                    lines.append(f"    {us:7.1f}  {label}")
            lines += _replays(buf, calls, args.iters, f"{name} {rows} rows")
            buf.destroy()
    if rank == 0:
        lines += _launcher_costs(args.iters)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shapes", default="S1,S2", help="empty: only the launch costs")
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--sms", type=int, default=8)
    args = parser.parse_args()
    print("\n".join(run_ranks(_rank, 1, args, device="cuda", timeout_s=400)[0]), flush=True)


if __name__ == "__main__":
    main()
