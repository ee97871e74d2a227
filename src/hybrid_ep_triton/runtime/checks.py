"""Argument checks shared by the public entry points: ValueError naming the argument, the
expected and the actual value."""

import torch
import triton

from .planner import FP8_GROUP, SCALED_FORMATS


def describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor of shape {tuple(value.shape)}, {value.dtype} on {value.device}"
    return type(value).__name__


def check_int(name: str, value, minimum: int, maximum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value!r}")


def check_quantize_format(
    name: str, value, hidden_size: int, *, takes_bools: bool, hint: str = ""
) -> str | None:
    """The block-scaled format that ``value`` asks a dispatch to quantize rows of
    ``hidden_size`` channels into as it sends: a name of SCALED_FORMATS, or None for none (with
    ``takes_bools``, as dispatch's quantize, also False for none and True for "fp8"). ValueError
    naming ``name`` otherwise, or when the hidden size is not a multiple of the 128 channels
    the quantizers take at a time (kernels/quantize.py); ``hint`` ends that message."""
    if value is None or (takes_bools and value is False):
        return None
    fmt = "fp8" if takes_bools and value is True else value
    if not isinstance(fmt, str) or fmt not in SCALED_FORMATS:
        choices = "False, True (fp8)" if takes_bools else "None"
        got = repr(value) if isinstance(value, str) else describe(value)
        raise ValueError(f"{name} must be {choices} or one of {tuple(SCALED_FORMATS)}, got {got}")
    if hidden_size % FP8_GROUP:
        raise ValueError(
            f"{name}={value!r} needs a hidden size that is a multiple of {FP8_GROUP} (the "
            f"dispatch quantizes {FP8_GROUP} channels at a time), got {hidden_size}{hint}"
        )
    return fmt


def check_tensor(
    name: str, t, shape: tuple | None, dtype: torch.dtype, device: torch.device
) -> None:
    """``t`` is a tensor of ``shape`` (None: any), ``dtype``, on ``device`` (a device without an
    index: any of its type)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    if shape is not None and t.shape != shape:  # a torch.Size is a tuple
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
    found = t.device  # a new torch.device per access
    if found != device and (found.type != device.type or device.index is not None):
        raise ValueError(f"{name} must be on {device}, got {found}")


def check_contiguous_rows(name: str, t: torch.Tensor) -> None:
    """A [M, N] tensor whose rows the kernels read as N consecutive elements: stride(1) == 1,
    which only matters where a row has more than one element (torch makes some empty or
    one-column tensors with another stride there)."""
    if t.stride(1) != 1 and t.shape[1] > 1 and t.shape[0] > 0:
        raise ValueError(f"{name} must have contiguous rows (stride(1) == 1)")


def check_interpreted_on_cpu(device: torch.device) -> None:
    """Kernels for tokens on the CPU (CPU ranks) run only in Triton's interpreter; without it,
    Triton's first launch would fail with "0 active drivers". Triton builds each kernel,
    interpreted or compiled, as the module defining it is imported: the variable must be set
    before."""
    if device.type == "cpu" and not triton.knobs.runtime.interpret:
        raise ValueError(
            "a Buffer on CPU ranks (tokens on the CPU) runs its kernels in Triton's interpreter: "
            "set TRITON_INTERPRET=1 in the environment before triton or hybrid_ep_triton is "
            "imported (e.g. TRITON_INTERPRET=1 torchrun ...); GPU ranks take a CUDA device"
        )
