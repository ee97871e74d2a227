"""KernelLauncher (ops/launch.py): launches through the compiled kernel's launcher once Triton
has specialised a kernel, through Triton again whenever the specialisation may differ; and the
tags that exact-mode layout launches take."""

import ctypes
from types import SimpleNamespace

import pytest
import torch
import triton
import triton.language as tl
from cuda.bindings import driver as cuda
from triton.runtime import JITFunction

from hybrid_ep_triton.ops import launch
from hybrid_ep_triton.ops.launch import KernelLauncher, TensorView

BLOCK = 64


@triton.jit
def _scale_kernel(x_ptr, out_ptr, n, scale, offset_ptr, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + cols, mask=mask)
    tl.store(out_ptr + cols, x * scale + tl.load(offset_ptr), mask=mask)


def test_launches_match_triton_across_specialisations(device):
    """On GPUs the later launches of each specialisation skip Triton: n = 1 then 5 (Triton
    specialises on 1), aligned then misaligned input, a view's address, another constexpr value
    (BLOCK 32 covers 32 of n = 40 columns); under the interpreter every launch goes through
    Triton."""
    offset = torch.tensor([0.5], device=device)
    launcher = KernelLauncher(_scale_kernel, scale=3.0, offset_ptr=offset)
    data = torch.randn(4 * BLOCK, device=device)
    base = torch.zeros(4 * BLOCK, device=device)
    calls = [
        (1, 0, 0, BLOCK),
        (5, 0, 8, BLOCK),
        (5, 0, 16, BLOCK),
        (1, 0, 24, BLOCK),
        (7, 1, 32, BLOCK),
        (7, 0, 40, BLOCK),
        (40, 0, 48, BLOCK),
        (40, 0, 56, 32),
        (40, 0, 64, 32),
    ]
    for n, start, view_start, block in calls:
        x = data[start : start + BLOCK]  # start 1: 4-byte aligned only
        out = TensorView(base, (BLOCK,), (1,), view_start)
        base.zero_()
        launcher((1,), specialized=dict(x_ptr=x, n=n, BLOCK=block), aligned=dict(out_ptr=out))
        expected = torch.zeros_like(base)
        written = min(n, block)
        expected[view_start : view_start + written] = x[:written] * 3.0 + 0.5
        torch.testing.assert_close(
            base, expected, msg=f"n={n}, x at {start}, out at {view_start}, BLOCK={block}"
        )


@pytest.mark.gpu
def test_relaunches_through_the_driver_match_triton():
    """A Relaunch of a compiled kernel goes through cuLaunchKernel (an fp32 argument among its
    parameters, a constexpr not; the int32 n and two pointers changing) and computes what
    Triton's launch does; one that would take another specialisation (n == 1) is refused."""
    offset = torch.tensor([0.25], device="cuda")
    launcher = KernelLauncher(_scale_kernel, scale=-1.5, offset_ptr=offset, BLOCK=BLOCK)
    base = torch.zeros(4 * BLOCK, device="cuda")
    relaunch = launcher(
        (1,),
        specialized=dict(x_ptr=torch.randn(BLOCK, device="cuda"), n=-3),
        aligned=dict(out_ptr=TensorView(base, (BLOCK,), (1,), BLOCK)),
        changing=("x_ptr", "n"),
        views_of=base,
    )
    assert isinstance(relaunch._launch, launch._DriverLaunch)
    for n in (5, 17, 40):
        x, other = torch.randn(BLOCK, device="cuda"), torch.zeros(4 * BLOCK, device="cuda")
        assert relaunch(x, n, other.data_ptr())
        expected = torch.zeros_like(other)
        expected[BLOCK : BLOCK + n] = x[:n] * -1.5 + 0.25
        torch.testing.assert_close(other, expected, msg=f"n={n}")
    assert not relaunch(x, 1, base.data_ptr())


_SIGNATURE = {
    "x_ptr": "*fp32",
    "out_ptr": "*fp32",
    "n": "i32",
    "scale": "fp32",
    "offset_ptr": "*fp32",
    "BLOCK": "constexpr",
}


class _FakeCompiled:
    """A compiled kernel of _scale_kernel that records the launches of its launcher; the
    launches through the driver are recorded by the fixture's cuLaunchKernel."""

    name, function = "_scale_kernel", 77

    def __init__(self):
        self.launches = []
        self.src = SimpleNamespace(fn=_scale_kernel, signature=_SIGNATURE, constants={(5,): BLOCK})
        self.metadata = SimpleNamespace(
            num_warps=4, num_ctas=1, shared=96, global_scratch_size=0, profile_scratch_size=0
        )

    def __getitem__(self, grid):
        return lambda *args, stream: self.launches.append((grid, args, stream))


def _driver_arguments(params: int) -> tuple:
    """The values a cuLaunchKernel parameter array of _scale_kernel points at, as the kernel
    reads them (BLOCK is not a parameter), then the two scratch pointers."""
    pointers = (ctypes.c_uint64 * 7).from_address(params)
    kinds = [
        ctypes.c_uint64,
        ctypes.c_uint64,
        ctypes.c_int32,
        ctypes.c_float,
        ctypes.c_uint64,
        ctypes.c_uint64,
        ctypes.c_uint64,
    ]
    return tuple(kind.from_address(p).value for kind, p in zip(kinds, pointers, strict=True))


class _FakeDriver:
    def get_current_device(self):
        return 3

    def get_current_stream(self, device):
        return 1000 + device


@pytest.fixture
def fake_triton(monkeypatch):
    """A JITFunction whose Triton launches are recorded (returning a fake compiled kernel), on
    a fake driver, and cuLaunchKernel recording what it is given: the launcher's bookkeeping
    without a GPU."""
    kernel = JITFunction(_scale_kernel.fn)
    compiled, through_triton = _FakeCompiled(), []

    def run(*args, grid, warmup, **kwargs):
        through_triton.append((grid, args, kwargs))
        return compiled

    def launch_kernel(function, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        compiled.driver_launches.append(
            ((function, gx, gy, gz, bx, by, bz, shared, stream, extra), _driver_arguments(params))
        )
        return (cuda.CUresult.CUDA_SUCCESS,)

    compiled.driver_launches = []
    monkeypatch.setattr(kernel, "run", run)
    monkeypatch.setattr(launch, "CompiledKernel", _FakeCompiled)
    monkeypatch.setattr(cuda, "cuLaunchKernel", launch_kernel)
    monkeypatch.setattr(launch, "_driver_api", lambda: cuda)  # reachable, whatever this host has
    # set_active's counterpart, reset_active, would start the real driver: restore instead.
    monkeypatch.setattr(triton.runtime.driver, "_active", _FakeDriver())
    return kernel, compiled, through_triton


def test_first_launch_of_a_specialisation_goes_through_triton(fake_triton):
    kernel, compiled, through_triton = fake_triton
    offset = torch.zeros(1)
    launcher = KernelLauncher(kernel, scale=2.0, offset_ptr=offset, BLOCK=BLOCK, num_warps=4)
    data, base = torch.zeros(256), torch.zeros(256)

    def call(x, n, view_start=0):
        out = TensorView(base, (BLOCK,), (1,), view_start)
        launcher((2,), specialized=dict(x_ptr=x, n=n), aligned=dict(out_ptr=out))

    call(data[:64], 7)
    assert len(through_triton) == 1 and not compiled.launches
    grid, args, options = through_triton[0]
    assert grid == (2,) and options == {"num_warps": 4}
    assert args[0] is not None and args[0].data_ptr() == data.data_ptr()
    assert isinstance(args[1], torch.Tensor) and args[1].data_ptr() == base.data_ptr()  # a view
    assert args[2:] == (7, 2.0, offset, BLOCK)

    # The same specialisation (another 16-byte aligned input, another view, n again neither 1
    # nor a multiple of 16): the compiled launcher, pointers as addresses.
    call(data[4:68], 9, view_start=8)
    assert len(through_triton) == 1
    ((grid, args, stream),) = compiled.launches
    assert grid == (2, 1, 1) and stream == 1003
    assert args == (data.data_ptr() + 16, base.data_ptr() + 32, 9, 2.0, offset.data_ptr(), BLOCK)

    # Specialisations Triton may tell apart go through Triton again: n == 1, n % 16 == 0, an
    # input address that is not a multiple of 16, another dtype, n beyond int32.
    for x, n in [
        (data[:64], 1),
        (data[:64], 32),
        (data[1:65], 9),
        (data.double()[:64], 9),
        (data[:64], 2**31),
    ]:
        call(x, n)
    assert len(through_triton) == 6 and len(compiled.launches) == 1
    assert launcher.builds == 6
    # Another grid takes its own launcher entry but compiles nothing new.
    out = TensorView(base, (BLOCK,), (1,), 0)
    launcher((3,), specialized=dict(x_ptr=data[:64], n=9), aligned=dict(out_ptr=out))
    assert len(through_triton) == 7 and launcher.builds == 6


def test_build_seconds_are_those_of_first_launches(fake_triton, monkeypatch):
    """build_seconds adds the host time of launches that go through Triton (compiling or
    loading), none of those that reuse a specialisation."""
    kernel, compiled, through_triton = fake_triton
    clock = iter([10.0, 13.5, 20.0, 20.25])  # read before and after each first launch only
    monkeypatch.setattr(launch, "perf_counter", lambda: next(clock))
    launcher = KernelLauncher(kernel, scale=2.0, offset_ptr=torch.zeros(1), BLOCK=BLOCK)
    x, out = torch.zeros(64), torch.zeros(64)
    for n in (7, 9, 32, 5):  # 7, 9 and 5 one specialisation, 32 another
        launcher((1,), specialized=dict(x_ptr=x, n=n), aligned=dict(out_ptr=out))
    assert len(through_triton) == 2 and launcher.build_seconds == 3.75


def test_integers_not_specialised_take_one_build(fake_triton, monkeypatch):
    """An integer the kernel does not specialise on (do_not_specialize, as the kernels'
    UNSPECIALISED) takes the same compiled kernel for 1, multiples of 16 and others; beyond int32
    another."""
    _, compiled, through_triton = fake_triton
    kernel = JITFunction(_scale_kernel.fn, do_not_specialize=["n"])
    monkeypatch.setattr(
        kernel, "run", lambda *a, grid, warmup, **k: through_triton.append(a) or compiled
    )
    launcher = KernelLauncher(kernel, scale=2.0, offset_ptr=torch.zeros(1), BLOCK=BLOCK)
    x, out = torch.zeros(64), torch.zeros(64)
    for n in (7, 1, 32, 9, 2**31):
        launcher((1,), specialized=dict(x_ptr=x, n=n), aligned=dict(out_ptr=out))
    assert [args[2] for args in through_triton] == [7, 2**31]
    assert [args[2] for _, args, _ in compiled.launches] == [1, 32, 9]


def test_constexprs_are_keyed_by_value(fake_triton):
    """A constexpr passed per call selects its compiled kernel by value (BLOCK 64 and 32 are
    both integers Triton would not tell apart as arguments)."""
    kernel, compiled, through_triton = fake_triton
    launcher = KernelLauncher(kernel, scale=2.0, offset_ptr=torch.zeros(1))
    x, out = torch.zeros(64), torch.zeros(64)
    for block in (64, 32, 64, 32):
        launcher((1,), specialized=dict(x_ptr=x, n=7, BLOCK=block), aligned=dict(out_ptr=out))
    assert [args[-1] for _, args, _ in through_triton] == [64, 32]
    assert [args[-1] for _, args, _ in compiled.launches] == [64, 32]


def test_relaunch_changes_the_named_arguments_within_a_specialisation(fake_triton):
    """A launch returns its Relaunch: launched again, through the driver, with new values of
    the ``changing`` arguments and a new base for the TensorViews of ``views_of`` (pointers as
    addresses), refused (False, nothing launched) where a value would take another
    specialisation; a constexpr cannot change."""
    kernel, compiled, through_triton = fake_triton
    offset = torch.zeros(1)
    launcher = KernelLauncher(kernel, scale=2.5, offset_ptr=offset, BLOCK=BLOCK)
    data, base, other = torch.zeros(256), torch.zeros(256), torch.zeros(256)
    relaunch = launcher(
        (2,),
        specialized=dict(x_ptr=data[:64], n=-7),
        aligned=dict(out_ptr=TensorView(base, (BLOCK,), (1,), 16)),
        changing=("x_ptr",),
        views_of=base,
    )
    assert len(through_triton) == 1 and not compiled.launches and not compiled.driver_launches
    assert relaunch(data[8:72], other.data_ptr())
    ((launch_config, arguments),) = compiled.driver_launches
    # function, grid, 4 warps, the kernel's shared memory, the stream, no ``extra``
    assert launch_config == (77, 2, 1, 1, 128, 1, 1, 96, 1003, 0)
    assert arguments == (
        data.data_ptr() + 32,
        other.data_ptr() + 64,
        -7,
        2.5,
        offset.data_ptr(),
        0,
        0,
    )
    for x in (data[1:65], data.double()[:64]):  # misaligned, another dtype
        assert not relaunch(x, base.data_ptr())
    assert len(compiled.driver_launches) == 1 and len(through_triton) == 1
    assert not compiled.launches
    with pytest.raises(TypeError, match="constexpr"):
        launcher(
            (2,),
            specialized=dict(x_ptr=data[:64], n=7, BLOCK=BLOCK),
            aligned=dict(out_ptr=base),
            changing=("BLOCK",),
        )


@pytest.mark.parametrize("needs", ["cluster", "global scratch", "launch hook", "no driver"])
def test_relaunch_takes_tritons_launcher_where_the_driver_launch_cannot(
    fake_triton, monkeypatch, needs
):
    """Kernels launched with attributes or scratch memory, launches a profiler hooks into, and
    launches where cuda-python cannot reach the driver relaunch through the compiled kernel's
    launcher."""
    kernel, compiled, through_triton = fake_triton
    if needs == "cluster":
        compiled.metadata.num_ctas = 2
    elif needs == "global scratch":
        compiled.metadata.global_scratch_size = 128
    elif needs == "launch hook":
        monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", lambda metadata: None)
    else:
        monkeypatch.setattr(launch, "_driver_api", lambda: None)
    launcher = KernelLauncher(kernel, scale=2.0, offset_ptr=torch.zeros(1), BLOCK=BLOCK)
    x, out = torch.zeros(64), torch.zeros(64)
    relaunch = launcher(
        (1,),
        specialized=dict(x_ptr=x, n=7),
        aligned=dict(out_ptr=out),
        changing=("n",),
        views_of=out,
    )
    assert relaunch(9, out.data_ptr())
    ((grid, args, stream),) = compiled.launches
    assert args[2] == 9 and stream == 1003 and not compiled.driver_launches


def test_no_relaunch_under_the_interpreter(device):
    if device != "cpu":
        pytest.skip("the interpreter runs on CPU ranks")
    launcher = KernelLauncher(_scale_kernel, scale=1.0, offset_ptr=torch.zeros(1))
    x, out = torch.ones(BLOCK), torch.zeros(BLOCK)
    assert (
        launcher(
            (1,),
            specialized=dict(x_ptr=x, n=3, BLOCK=BLOCK),
            aligned=dict(out_ptr=out),
            changing=("x_ptr",),
        )
        is None
    )
    assert out[:3].tolist() == [1.0, 1.0, 1.0]


def test_missing_argument_is_an_error_before_launching(fake_triton):
    kernel, compiled, through_triton = fake_triton
    launcher = KernelLauncher(kernel, scale=2.0, BLOCK=BLOCK)
    with pytest.raises(TypeError, match="offset_ptr"):
        launcher(
            (1,),
            specialized=dict(x_ptr=torch.zeros(64), n=3),
            aligned=dict(out_ptr=torch.zeros(64)),
        )
    assert not through_triton and not compiled.launches


def test_report_tags_never_repeat_the_previous_call():
    """Exact-mode dispatches poll host memory for their layout's tag: a tag equal to the
    previous call's would let a call read the previous call's row count without waiting."""
    from hybrid_ep_triton.ops.runtime import report_tag

    calls = [*range(1000), 2**29 - 1, 2**29, 2**29 + 1]  # and across the wrap
    tags = [report_tag(call) for call in calls]
    assert all(a != b for a, b in zip(tags, tags[1:], strict=False)), tags[:8]
    assert all(t % 2 == 1 and 1 < t < 2**31 for t in tags), tags[:8]  # one specialisation
