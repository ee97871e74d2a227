"""Argument checks of the public entry points: ValueError naming the argument, the expected and
the actual value. ``refusing`` turns a check's ValueError into ``Refused``, which names the
argument for the refusal protocol (ops/refusal.py)."""

from dataclasses import dataclass

import torch
import torch.distributed as dist
import triton

from ..kernels.control import LL_MAX_ROWS
from .planner import FP8_GROUP, MAX_SMS, MAX_TOPK, SCALED_FORMATS, Plan, ScaledFormat

# The most tokens a low-latency call may take a rank (a flag counts a block's rows in 16 bits).
MAX_LOW_LATENCY_TOKENS = int(LL_MAX_ROWS)
# Token dtypes a Buffer takes.
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class Refused(Exception):
    """The host refused ``argument``: ``error`` is the ValueError that says why."""

    def __init__(self, argument: str, error: ValueError):
        super().__init__(argument)
        self.argument, self.error = argument, error


class RefusedEarlier(ValueError):
    """A dispatch with a new layout that tells every rank of a refusal in an earlier call along
    a handle (a cached dispatch or a combine, this rank's or a peer's): it moved nothing, and
    the next dispatch goes ahead."""


class refusing:
    """``with refusing(argument):`` checks of ``argument``: their ValueError becomes a Refused
    naming it. A class, not a contextlib.contextmanager: every dispatch and combine enters
    several, and on a 2-core x86 host a generator's cost 1.3 µs each, a class's 0.25 µs."""

    __slots__ = ("argument",)

    def __init__(self, argument: str):
        self.argument = argument

    def __enter__(self) -> None:
        pass

    def __exit__(self, kind, error, traceback) -> None:
        if kind is not None and issubclass(kind, ValueError):
            raise Refused(self.argument, error) from None


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


def check_maskable(rank, own_rank: int, world_size: int) -> None:
    """ValueError unless ``rank`` is another rank of the group: a rank cannot mask itself."""
    check_int("rank", rank, 0, world_size - 1)
    if rank == own_rank:
        raise ValueError(f"rank {rank} is this Buffer's own rank, which it cannot mask")


def check_mask_out(out, world_size: int, device: torch.device | None) -> None:
    """ValueError unless ``out`` is an int32 [world_size] tensor (on ``device`` unless None)."""
    if not (
        isinstance(out, torch.Tensor)
        and out.dtype == torch.int32
        and out.shape == (world_size,)
        and device in (None, out.device)
    ):
        where = "" if device is None else f" on {device}"
        raise ValueError(
            f"the mask's output must be an int32 [{world_size}] tensor{where}, got {describe(out)}"
        )


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


def check_routing(name: str, topk_idx, num_tokens: int, device: torch.device) -> int:
    """topk_idx: [num_tokens, K] int32 or int64 on ``device``, K >= 1; returns K."""
    if topk_idx is None:
        raise ValueError(f"{name} is required without a handle")
    if not isinstance(topk_idx, torch.Tensor) or topk_idx.dim() != 2:
        raise ValueError(f"{name} must be a [T, K] tensor, got {describe(topk_idx)}")
    if topk_idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be int32 or int64, got {topk_idx.dtype}")
    topk = topk_idx.shape[1]
    check_tensor(name, topk_idx, (num_tokens, topk), topk_idx.dtype, device)
    if topk < 1:
        raise ValueError(f"{name} must have at least one slot per token (K >= 1)")
    return topk


class ArgumentRecord:
    """A frozen dataclass of a public call's arguments, by the names of its signature."""

    @classmethod
    def of(cls, arguments: dict):
        """The record of the call whose ``locals()`` are ``arguments``, its fields picked by
        name (by ``__dataclass_fields__``: torch.compile traces no ``dataclasses.fields``).
        torch.compile traces no locals() of a function that has a closure over a local not yet
        assigned: a method that makes the record so passes it to another for its work."""
        return cls(**{name: arguments[name] for name in cls.__dataclass_fields__})


@dataclass(frozen=True)
class LowLatencyDispatchArguments(ArgumentRecord):
    """Buffer.low_latency_dispatch's arguments, unchecked (its docstring says what each is),
    with its defaults for a dispatch that the Buffer makes itself (clean_low_latency_buffer)."""

    x: torch.Tensor
    topk_idx: torch.Tensor
    num_max_dispatch_tokens_per_rank: int
    num_experts: int
    cumulative_local_expert_recv_stats: torch.Tensor | None = None
    use_fp8: bool = True
    round_scale: bool = False
    use_ue8m0: bool = False
    async_finish: bool = False
    return_recv_hook: bool = False
    previous_event: torch.cuda.Event | None = None


@dataclass(frozen=True)
class LowLatencyCombineArguments(ArgumentRecord):
    """Buffer.low_latency_combine's arguments, unchecked (its docstring says what each is;
    ``handle``: a low-latency dispatch's handle, ops.low_latency.LowLatencyHandle)."""

    x: torch.Tensor
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    handle: tuple
    zero_copy: bool
    async_finish: bool
    return_recv_hook: bool
    out: torch.Tensor | None
    previous_event: torch.cuda.Event | None


def check_low_latency_dispatch(
    plan: Plan, device: torch.device, args: LowLatencyDispatchArguments
) -> None:
    """A low-latency dispatch's arguments against the Buffer's ``plan``: ValueError naming the
    first that does not fit."""
    max_tokens, x = args.num_max_dispatch_tokens_per_rank, args.x
    check_int("num_max_dispatch_tokens_per_rank", max_tokens, 1, plan.low_latency.tokens)
    if args.num_experts != plan.num_experts:
        raise ValueError(
            f"num_experts must be the Buffer's {plan.num_experts}, got {args.num_experts}"
        )
    for name in ("use_fp8", "round_scale", "use_ue8m0"):
        check_flag(name, getattr(args, name))
    if args.use_fp8 and plan.hidden % FP8_GROUP:
        raise ValueError(
            f"use_fp8 needs a hidden size that is a multiple of {FP8_GROUP}, the Buffer's is "
            f"{plan.hidden}"
        )
    if args.use_ue8m0 and not (args.use_fp8 and args.round_scale):
        raise ValueError("use_ue8m0 needs use_fp8=True and round_scale=True (as DeepEP's)")
    check_tensor("x", x, None, plan.dtype, device)
    if x.dim() != 2 or x.shape[1] != plan.hidden:
        raise ValueError(f"x must be a [T, {plan.hidden}] tensor, got {tuple(x.shape)}")
    if x.shape[0] > max_tokens:
        raise ValueError(
            f"x has {x.shape[0]} tokens, more than num_max_dispatch_tokens_per_rank={max_tokens}"
        )
    check_contiguous_rows("x", x)
    topk = check_routing("topk_idx", args.topk_idx, x.shape[0], device)
    if topk > MAX_TOPK:
        raise ValueError(f"topk_idx must have 1 to {MAX_TOPK} slots per token, got K={topk}")
    stats = args.cumulative_local_expert_recv_stats
    if stats is not None:
        shape = (plan.experts_per_rank,)
        check_tensor("cumulative_local_expert_recv_stats", stats, shape, torch.int32, device)
    check_event(args.previous_event, device.type == "cuda")


def check_low_latency_combine(
    plan: Plan,
    device: torch.device,
    args: LowLatencyCombineArguments,
    combine_buffer: torch.Tensor,
) -> None:
    """A low-latency combine's arguments against the Buffer's ``plan`` and the handle (a
    low-latency handle of this Buffer, checked before), with ``combine_buffer`` the buffer
    that get_next_low_latency_combine_buffer returned for this call (zero_copy's x):
    ValueError naming the first that does not fit."""
    x, token_slots = args.x, args.handle.token_slots
    for name in ("zero_copy", "return_recv_hook", "async_finish"):
        check_flag(name, getattr(args, name))
    shape = (plan.experts_per_rank, args.handle.src_info.shape[1], plan.hidden)
    check_tensor("x", x, shape, plan.dtype, device)
    if x.stride(2) != 1 and plan.hidden > 1:
        raise ValueError("x must have contiguous rows (stride(2) == 1)")
    topk_idx, topk_weights = args.topk_idx, args.topk_weights
    check_tensor("topk_idx", topk_idx, tuple(token_slots.shape), topk_idx.dtype, device)
    if topk_idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_idx must be int32 or int64, got {topk_idx.dtype}")
    check_contiguous_rows("topk_idx", topk_idx)
    check_tensor("topk_weights", topk_weights, tuple(token_slots.shape), torch.float32, device)
    check_contiguous_rows("topk_weights", topk_weights)
    if args.out is not None:
        shape = (token_slots.shape[0], plan.hidden)
        check_tensor("out", args.out, shape, plan.dtype, device)
        if not args.out.is_contiguous():
            raise ValueError("out must be contiguous")
    if args.zero_copy and x.data_ptr() != combine_buffer.data_ptr():
        raise ValueError(
            "zero_copy takes the buffer that get_next_low_latency_combine_buffer returned "
            "right before this call as x"
        )
    check_event(args.previous_event, device.type == "cuda")


def check_event(event, on_gpu: bool) -> None:
    """previous_event: a torch.cuda.Event on GPUs, or None."""
    if event is None:
        return
    if not on_gpu or not isinstance(event, torch.cuda.Event):
        raise ValueError(
            f"previous_event must be a torch.cuda.Event on GPUs or None, got {describe(event)}"
        )


def check_tokens(
    name: str,
    x,
    plan: Plan,
    device: torch.device,
    dtype: torch.dtype | None = None,
    cols: int | None = None,
) -> None:
    """x: [T, cols] (default: [T, H]) of ``dtype`` (default: the Buffer's), T <=
    max_tokens_per_rank, rows contiguous."""
    check_tensor(name, x, None, dtype or plan.dtype, device)
    shape = x.shape
    cols = cols or plan.hidden
    if len(shape) != 2 or shape[1] != cols:
        raise ValueError(f"{name} must be a [T, {cols}] tensor, got {tuple(shape)}")
    if shape[0] > plan.max_tokens:
        raise ValueError(
            f"{name} has {shape[0]} tokens, more than max_tokens_per_rank={plan.max_tokens}"
        )
    check_contiguous_rows(name, x)


def pair_dtypes(fmt: ScaledFormat) -> tuple[torch.dtype, torch.dtype]:
    return fmt.values_dtype, fmt.scale_dtype


def check_pair(pair, plan: Plan, device: torch.device, scaled_values: type) -> str:
    """A (values, scales) pair of rows of a block-scaled format, checked; returns the format's
    name. ``scaled_values``: the type of a quantizing dispatch's values (ops.ScaledValues),
    which a pair may not take."""
    if len(pair) != 2:
        raise ValueError(f"block-scaled rows are a pair (values, scales), got {len(pair)} items")
    values, scales = pair
    if not plan.scaled:
        blocks = ", ".join(f"{f.block} ({f.name})" for f in SCALED_FORMATS.values())
        raise ValueError(
            f"block-scaled rows need a hidden size that is a multiple of {blocks}, this "
            f"Buffer's is {plan.hidden}"
        )
    if isinstance(values, scaled_values):
        raise ValueError(
            "a pair's values must be a plain tensor, got a ScaledValues (the values of a "
            "quantizing dispatch of rows that require grad): pass its .quantized, which "
            "carries no gradient, or the ScaledValues alone as rows of its dtype"
        )
    dtypes = (getattr(values, "dtype", None), getattr(scales, "dtype", None))
    fmt = next((f for f in SCALED_FORMATS.values() if dtypes == pair_dtypes(f)), None)
    if fmt is None:
        known = ", ".join(f"{f.name} {pair_dtypes(f)}" for f in SCALED_FORMATS.values())
        raise ValueError(
            f"a pair's (values, scales) dtypes name its format, one of {known}; got "
            f"({describe(values)}, {describe(scales)})".replace("torch.", "")
        )
    if plan.scaled_rows(fmt.name) is None:
        raise ValueError(
            f"{fmt.name} rows need a hidden size that is a multiple of {fmt.block} (and of "
            f"{4 * fmt.channels_per_byte}), this Buffer's is {plan.hidden}"
        )
    check_tokens(
        f"{fmt.name} values",
        values,
        plan,
        device,
        fmt.values_dtype,
        fmt.values_shape(0, plan.hidden)[1],
    )
    check_tensor(
        f"{fmt.name} scales",
        scales,
        fmt.scales_shape(values.shape[0], plan.hidden),
        fmt.scale_dtype,
        device,
    )
    check_contiguous_rows(f"{fmt.name} scales", scales)
    # (torch.compile cannot trace storage_offset(); the operator's view as words checks it.)
    offset = 0 if torch.compiler.is_compiling() else values.storage_offset()
    if values.stride(0) % 4 or offset % 4:
        raise ValueError(
            f"{fmt.name} values must start and have a row stride at multiples of 4 bytes "
            f"(they move as 32-bit words), got stride {values.stride(0)}, offset {offset}"
        )
    if values.requires_grad or scales.requires_grad:
        raise ValueError(
            "a pair carries no gradient: dispatch rows of the Buffer's dtype with quantize "
            "to have one"
        )
    return fmt.name


@dataclass(frozen=True)
class BufferOptions(ArgumentRecord):
    """Buffer's constructor arguments but the group and the heap (its docstring says what each
    is)."""

    hidden_size: int
    max_tokens_per_rank: int
    num_experts: int
    dtype: torch.dtype
    num_sms: int | None
    timeout_s: float
    expand: bool
    ranks_per_node: int | None
    device: torch.device | str | None
    agree_on_inputs: bool
    low_latency_tokens: int
    mask_failed_ranks: bool


def check_parameters(world: int, options: BufferOptions) -> None:
    """Buffer's parameters as this rank sees them alone: ValueError naming the first bad one."""
    if options.ranks_per_node is not None:
        check_int("ranks_per_node", options.ranks_per_node, 1, world)
        if world % options.ranks_per_node:
            raise ValueError(
                f"ranks_per_node must divide the group size {world}, got {options.ranks_per_node}"
            )
    check_int("hidden_size", options.hidden_size, 1)
    check_int("max_tokens_per_rank", options.max_tokens_per_rank, 0)
    check_int("num_experts", options.num_experts, 1)
    if options.num_experts % world:
        raise ValueError(
            f"num_experts must be divisible by the group size {world}, got {options.num_experts}"
        )
    if options.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {options.dtype}")
    if options.num_sms is not None:
        check_int("num_sms", options.num_sms, 1, MAX_SMS)
    if not options.timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {options.timeout_s}")
    for name in ("expand", "agree_on_inputs", "mask_failed_ranks"):
        check_flag(name, getattr(options, name))
    check_int("low_latency_tokens", options.low_latency_tokens, 0, MAX_LOW_LATENCY_TOKENS)
    check_interpreted_on_cpu(options.device)


def token_device(device, group: dist.ProcessGroup) -> torch.device:
    """Buffer's ``device`` resolved (see its docstring); ValueError before anything is made."""
    nccl = dist.get_backend(group) == "nccl"
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be a torch.device, got {describe(device)}") from None
    if device.type == "cpu":
        if nccl:
            raise ValueError("device is the CPU but the group is NCCL: CPU ranks use gloo")
        return device
    if device.type != "cuda":
        raise ValueError(f"device must be a CUDA device or the CPU, got {device}")
    if not torch.cuda.is_available():
        raise ValueError(f"device is {device}, but torch sees no CUDA device")
    current = torch.cuda.current_device()
    if device.index is not None and device.index != current:
        raise ValueError(
            f"device {device} is not this process's CUDA device (cuda:{current}): call "
            "torch.cuda.set_device first (one GPU per process, as NVSHMEM wants)"
        )
    return torch.device("cuda", current)


def ranks_per_host(hosts: list[str]) -> int:
    """Ranks per node when nodes are hosts (``hosts``: each rank's host name, in rank order): how
    many ranks share the first rank's host, after checking that every host holds that many
    consecutive ranks."""
    per_host = hosts.count(hosts[0])
    blocks = [tuple(hosts[i : i + per_host]) for i in range(0, len(hosts), per_host)]
    if any(len(set(block)) != 1 or len(block) != per_host for block in blocks) or len(
        {block[0] for block in blocks}
    ) != len(blocks):
        raise ValueError(
            f"the ranks of each host must be consecutive and as many on every host (hosts in "
            f"rank order: {hosts}); pass ranks_per_node to say what a node is"
        )
    return per_host


@dataclass(frozen=True)
class DispatchArguments(ArgumentRecord):
    """Buffer.dispatch's arguments, unchecked (its docstring says what each is; ``handle``: a
    DispatchHandle, whose num_tokens and topk a cached dispatch takes, or None)."""

    x: torch.Tensor | tuple[torch.Tensor, torch.Tensor]
    topk_idx: torch.Tensor | None
    topk_weights: torch.Tensor | None
    pad_multiple: int
    max_recv_tokens: int | None
    handle: object
    quantize: bool | str
    expert_recv_stats: torch.Tensor | None
    previous_event: torch.cuda.Event | None
    async_finish: bool


def check_dispatch_inputs(
    plan: Plan, device: torch.device, args: DispatchArguments, scaled_values: type
) -> tuple:
    """Buffer.dispatch's inputs: Refused naming the argument that fails (``scaled_values`` as
    for check_pair). Returns x (the rows, or a pair's values), a pair's scales or None, and the
    block-scaled format of recv_x or None (rows of the Buffer's dtype)."""
    x, topk_idx, handle = args.x, args.topk_idx, args.handle
    x_scales = None
    with refusing("quantize"):
        scaled = check_quantize_format(
            "quantize",
            args.quantize,
            plan.hidden,
            takes_bools=True,
            hint=" (pass rows quantized beforehand as a (values, scales) pair instead)",
        )
    with refusing("x"):
        if isinstance(x, tuple):
            if scaled is not None:
                raise ValueError(
                    f"quantize={args.quantize!r} takes rows of the Buffer's dtype, not a pair"
                )
            scaled = check_pair(x, plan, device, scaled_values)
            x, x_scales = x
        else:
            check_tokens("x", x, plan, device)
    num_tokens = x.shape[0]
    if handle is None:
        with refusing("topk_idx"):
            topk = check_routing("topk_idx", topk_idx, num_tokens, device)
            if min(topk, plan.experts_per_rank) > plan.slot_entries:
                raise ValueError(
                    f"topk_idx has K={topk} slots; with {plan.experts_per_rank} experts per "
                    f"rank at most {MAX_TOPK} are supported"
                )
        with refusing("pad_multiple"):
            check_int("pad_multiple", args.pad_multiple, 1)
        if args.max_recv_tokens is not None:
            with refusing("max_recv_tokens"):
                check_int("max_recv_tokens", args.max_recv_tokens, 0)
    else:
        with refusing("handle"):
            if num_tokens != handle.num_tokens:
                raise ValueError(
                    f"x must have the handle's {handle.num_tokens} tokens, got {num_tokens}"
                )
        topk = handle.topk
    if args.topk_weights is not None:
        with refusing("topk_weights"):
            shape = (num_tokens, topk)
            check_tensor("topk_weights", args.topk_weights, shape, torch.float32, device)
    if args.expert_recv_stats is not None:
        with refusing("expert_recv_stats"):
            if handle is not None:
                raise ValueError("expert_recv_stats counts routing: pass it without a handle")
            check_tensor(
                "expert_recv_stats",
                args.expert_recv_stats,
                (plan.experts_per_rank,),
                torch.int64,
                device,
            )
    with refusing("previous_event"):
        check_event(args.previous_event, device.type == "cuda")
    return x, x_scales, scaled


def check_combine_inputs(
    plan: Plan, device: torch.device, y, weights, topk_weights, handle, previous_event
) -> None:
    """Buffer.combine's inputs along ``handle`` (a DispatchHandle): Refused naming the argument
    that fails."""
    num_recv_rows = handle.num_recv_rows
    with refusing("y"):
        check_tensor("y", y, (num_recv_rows, plan.hidden), plan.dtype, device)
        check_contiguous_rows("y", y)
    if weights is not None:
        with refusing("weights"):
            check_tensor("weights", weights, (num_recv_rows,), torch.float32, device)
    if topk_weights is not None:
        with refusing("topk_weights"):
            if not plan.token_rows:
                raise ValueError(
                    "topk_weights are summed back per slot for token rows (expand=False); "
                    "an expert-major row is one slot: pass its factor as weights"
                )
            shape = (num_recv_rows, handle.topk)
            check_tensor("topk_weights", topk_weights, shape, torch.float32, device)
            if topk_weights.requires_grad and torch.is_grad_enabled():
                raise ValueError("combine's topk_weights take no gradient: pass them detached")
    with refusing("previous_event"):
        check_event(previous_event, device.type == "cuda")


def gather_or_refuse(
    group: dist.ProcessGroup,
    value,
    refused: Exception | None,
    subject: str = "the Buffer's parameters",
) -> list:
    """Every rank's ``value`` (collective), unless some rank's host refused ``subject``
    (``refused`` says why): then a ValueError on every rank, the refusing rank's own, the others
    naming the first refusing rank, its subject and its reason."""
    everyone = [None] * dist.get_world_size(group)
    said = None if refused is None else f"{subject}: {refused}"
    dist.all_gather_object(everyone, (value, said), group=group)
    if refused is not None:
        raise refused from None  # (raised while handling a Refused, say: that is not news)
    for r, (_, said) in enumerate(everyone):
        if said is not None:
            raise ValueError(f"rank {r} refused {said}")
    return [v for v, _ in everyone]


def check_same_on_all_ranks(group: dist.ProcessGroup, refused: ValueError | None, **params):
    """Every rank passed the same ``params`` (collective; a rank's ``refused`` parameters are
    a ValueError on every rank first)."""
    everyone = gather_or_refuse(group, params, refused)
    for key, value in params.items():
        values = [p[key] for p in everyone]
        if any(v != value for v in values):
            raise ValueError(f"{key} differs between ranks: {values} (rank order)")
