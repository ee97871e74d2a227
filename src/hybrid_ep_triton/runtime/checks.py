"""Argument checks shared by the public entry points: ValueError naming the argument, the
expected and the actual value."""

import torch
import triton

from .planner import FP8_GROUP, MAX_TOPK, SCALED_FORMATS


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


def check_flag(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {describe(value)}")


def check_routing(
    name: str, topk_idx, num_tokens: int, device: torch.device, most_slots: int
) -> int:
    """topk_idx: [num_tokens, K] int32 or int64 on ``device``, 1 <= K <= most_slots, rows
    contiguous; returns K."""
    if not isinstance(topk_idx, torch.Tensor) or topk_idx.dim() != 2:
        raise ValueError(f"{name} must be a [T, K] tensor, got {describe(topk_idx)}")
    if topk_idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be int32 or int64, got {topk_idx.dtype}")
    topk = topk_idx.shape[1]
    check_tensor(name, topk_idx, (num_tokens, topk), topk_idx.dtype, device)
    if not 1 <= topk <= most_slots:
        raise ValueError(f"{name} must have 1 to {most_slots} slots per token, got K={topk}")
    check_contiguous_rows(name, topk_idx)
    return topk


def check_low_latency_dispatch(
    plan, device: torch.device, x, topk_idx, max_tokens, num_experts, stats, use_fp8,
    round_scale, use_ue8m0,
) -> None:  # fmt: skip
    """A low-latency dispatch's inputs against the Buffer's ``plan``: ValueError naming the
    first that does not fit."""
    check_int("num_max_dispatch_tokens_per_rank", max_tokens, 1, plan.low_latency.tokens)
    if num_experts != plan.num_experts:
        raise ValueError(f"num_experts must be the Buffer's {plan.num_experts}, got {num_experts}")
    for name, flag in (("use_fp8", use_fp8), ("round_scale", round_scale),
                       ("use_ue8m0", use_ue8m0)):  # fmt: skip
        check_flag(name, flag)
    if use_fp8 and plan.hidden % FP8_GROUP:
        raise ValueError(
            f"use_fp8 needs a hidden size that is a multiple of {FP8_GROUP}, the Buffer's is "
            f"{plan.hidden}"
        )
    if use_ue8m0 and not (use_fp8 and round_scale):
        raise ValueError("use_ue8m0 needs use_fp8=True and round_scale=True (as DeepEP's)")
    check_tensor("x", x, None, plan.dtype, device)
    if x.dim() != 2 or x.shape[1] != plan.hidden:
        raise ValueError(f"x must be a [T, {plan.hidden}] tensor, got {tuple(x.shape)}")
    if x.shape[0] > max_tokens:
        raise ValueError(
            f"x has {x.shape[0]} tokens, more than num_max_dispatch_tokens_per_rank={max_tokens}"
        )
    check_contiguous_rows("x", x)
    check_routing("topk_idx", topk_idx, x.shape[0], device, MAX_TOPK)
    if stats is not None:
        check_tensor("cumulative_local_expert_recv_stats", stats, (plan.experts_per_rank,),
                     torch.int32, device)  # fmt: skip


def check_low_latency_combine(
    plan, device: torch.device, x, topk_idx, topk_weights, token_slots, rows: int, out
) -> None:
    """A low-latency combine's inputs against the Buffer's ``plan`` and its handle's
    ``token_slots`` [T, K] and ``rows`` (W * M'): ValueError naming the first that does not
    fit."""
    shape = (plan.experts_per_rank, rows, plan.hidden)
    check_tensor("x", x, shape, plan.dtype, device)
    if x.stride(2) != 1 and plan.hidden > 1:
        raise ValueError("x must have contiguous rows (stride(2) == 1)")
    check_tensor("topk_idx", topk_idx, tuple(token_slots.shape), topk_idx.dtype, device)
    if topk_idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_idx must be int32 or int64, got {topk_idx.dtype}")
    check_contiguous_rows("topk_idx", topk_idx)
    check_tensor("topk_weights", topk_weights, tuple(token_slots.shape), torch.float32, device)
    check_contiguous_rows("topk_weights", topk_weights)
    if out is not None:
        check_tensor("out", out, (token_slots.shape[0], plan.hidden), plan.dtype, device)
        if not out.is_contiguous():
            raise ValueError("out must be contiguous")
