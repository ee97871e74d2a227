"""DispatchHandle: what a dispatch leaves for combine and for cached dispatches, all in one
int64 tensor."""

import functools
import math
from dataclasses import dataclass

import torch

from ..kernels.control import INFO_WORDS
from ..runtime.checks import describe
from ..runtime.planner import Plan, ceil_div
from .launch import TensorView

# Why a rank's dispatch cannot go ahead, as its layout publishes it to every rank (0: it can):
# the device found its topk_idx invalid, or its host refused one of REFUSABLE: an argument of
# this dispatch, or one of ALONG_A_HANDLE, an argument of an earlier call along a handle (a
# cached dispatch or a combine), which the refusing rank still ran with zero rows so that no
# peer waited for it, and whose refusal its next dispatch with a new layout publishes instead.
INVALID_ROUTING = 1
ALONG_A_HANDLE = (
    *(
        f"cached dispatch's {argument}"
        for argument in (
            "quantize",
            "x",
            "topk_weights",
            "handle",
            "expert_recv_stats",
            "previous_event",
        )
    ),
    *(f"combine's {argument}" for argument in ("y", "weights", "topk_weights", "previous_event")),
)
REFUSABLE = (
    "x",
    "topk_idx",
    "topk_weights",
    "pad_multiple",
    "max_recv_tokens",
    "previous_event",
    "expert_recv_stats",
    "quantize",
    *ALONG_A_HANDLE,
)


def refusal_code(argument: str) -> int:
    """The code a rank's layout publishes when its host refused ``argument`` (in REFUSABLE)."""
    return INVALID_ROUTING + 1 + REFUSABLE.index(argument)


def refused_argument(cause: int) -> str:
    """The argument behind a published refusal code."""
    return REFUSABLE[cause - INVALID_ROUTING - 1]


class _Part:
    """An int32 part of a handle: a view of its ``state``, made on first access (launches take
    the parts by address, ``DispatchHandle.args``, and most never need the view). ``part``:
    the part's name where the attribute has another."""

    def __init__(self, part: str | None = None):
        self.part = part

    def __set_name__(self, owner, name: str) -> None:
        self.name = name
        self.part = self.part or name

    def __get__(self, handle, owner=None):
        if handle is None:
            return self
        view = handle._views[self.part].tensor()
        handle.__dict__[self.name] = view  # found there from now on
        return view


class _Ints:
    """A handle's ``state`` as int32, which the int32 parts are views of: made on first access
    (a view costs host time, and only a launch through Triton needs it)."""

    def __get__(self, handle, owner=None):
        if handle is None:
            return self
        ints = handle.__dict__["ints"] = handle.state.view(torch.int32)
        return ints


@dataclass
class DispatchHandle:
    """Everything combine and a cached dispatch need; produced by ``Buffer.dispatch``.

    All of it lives in one int64 tensor, ``state``, so that a dispatch allocates it once and
    the torch.library operators pass a handle as two tensors, topk_idx and state
    (``make_handle`` rebuilds it). ``state`` starts with the handle's info [4] (read through
    ``state``, no view of its own), then tokens_per_expert [L], then the int32 parts, each on a
    16-byte boundary (views of ``ints``, ``state`` as int32):
    Sender side (this rank's tokens):
        topk_idx [T, K] int32 or int64 (a tensor of its own), slot_pos [T, K] int32,
        token_rank_pos [T, W] int32, send_chunk_start [NC_MAX + 1, W] int32,
        chunk_expert_base [NC + 1, E] int32 (row 0: destination row of each expert's first
        slot from this rank; row c + 1: offset of chunk c's first slot among them).
    Receiver side (rows that came to this rank):
        recv_chunk_start [W, NC_MAX + 1] int32, recv_src_tokens [W] int32,
        expert_layout [3, L] int32 (segment start, valid rows, padded rows),
        tokens_per_expert [L] int64, staged_rows [W, T_MAX, MS] int32 (filled by the data move),
        with token rows: recv_rank_prefix [W] int32 (rows received from sources 0..s),
        recv_topk_idx [N, K] of topk_idx's dtype and recv_src_idx [N] int32 (filled by the
        data move; tensors of their own).
    Across nodes (empty within one node): token_node_pos [T, N] int32 and
        send_chunk_node_start [NC_MAX + 1, N] int32 (this rank's streams to the other nodes),
        recv_net_chunk_start [N, NC_MAX + 1] int32 (the streams to this node that this rank
        forwards), fwd_rows [N, T_MAX, R] int32 (each forwarded row's row at every node rank,
        filled by the data move).
    Info: [0] rows the output needs (expert-major: padding included; token rows: the tokens
        received; even past max_recv_tokens), [1] first rank whose dispatch could not go
        ahead or -1, [2] first invalid row of this rank's topk_idx (or a large value), [3] why
        rank [1]'s could not (INVALID_ROUTING, or the code of an argument its host refused).
    num_recv_rows: N, the rows of recv_x.
    parts: (shape, strides, offset) of each int32 part in ``ints``, by name.
    """

    num_tokens: int
    topk: int
    num_recv_rows: int
    max_recv_tokens: int | None
    topk_idx: torch.Tensor
    state: torch.Tensor
    tokens_per_expert: torch.Tensor
    parts: dict
    token_rows: bool = False
    recv_topk_idx: torch.Tensor | None = None
    source_index: torch.Tensor | None = None  # recv_src_idx's tensor
    # tokens_per_expert as the host has it from an exact-mode layout's report, or None.
    reported_tokens_per_expert: list[int] | None = None

    ints = _Ints()
    slot_pos = _Part()
    token_rank_pos = _Part()
    send_chunk_start = _Part()
    chunk_expert_base = _Part()
    recv_chunk_start = _Part()
    recv_src_tokens = _Part()
    _rank_prefix = _Part("recv_rank_prefix")
    expert_layout = _Part()
    staged_rows = _Part()
    token_node_pos = _Part()
    send_chunk_node_start = _Part()
    recv_net_chunk_start = _Part()
    fwd_rows = _Part()

    @functools.cached_property
    def _views(self) -> dict[str, TensorView]:
        return {name: TensorView(self.ints, *layout) for name, layout in self.parts.items()}

    @property
    def tokens_per_expert_list(self) -> list[int]:
        """tokens_per_expert as L Python ints: for an exact-mode dispatch on a GPU, as its
        layout reported them to the host (no wait for the device); else read from the device
        (a synchronisation)."""
        if self.reported_tokens_per_expert is not None:
            return self.reported_tokens_per_expert
        return self.tokens_per_expert.tolist()

    @property
    def recv_src_idx(self) -> torch.Tensor:
        """[N] int32: each token row's index among its source rank's tokens (-1 past the
        received rows)."""
        self._check_token_rows("recv_src_idx")
        return self.source_index

    @property
    def recv_rank_prefix(self) -> torch.Tensor:
        """[W] int32: token rows received from ranks 0..r, so that rows [prefix[r - 1],
        prefix[r]) came from rank r."""
        self._check_token_rows("recv_rank_prefix")
        return self._rank_prefix

    def _check_token_rows(self, name: str) -> None:
        if not self.token_rows:
            raise ValueError(
                f"{name} is a token row's (Buffer(expand=False)): an expert-major row's source "
                "is its token's, which combine sums back"
            )

    def args(self, *names: str) -> dict[str, TensorView]:
        """The int32 parts ``names`` as kernel arguments, by parameter name (``<part>_ptr``)."""
        views = self._views
        return {f"{name}_ptr": views[name] for name in names}


def _int_parts(plan: Plan, num_tokens: int, topk: int) -> dict[str, tuple[int, ...]]:
    """Shapes of the int32 parts of a handle, in ``state`` order."""
    world, experts, nodes = plan.world_size, plan.num_experts, plan.nodes
    num_chunks = ceil_div(num_tokens, plan.config.chunk_tokens)
    across = nodes > 1
    return {
        "slot_pos": (num_tokens, topk),
        "token_rank_pos": (num_tokens, world),
        "send_chunk_start": (plan.max_chunks + 1, world),
        "chunk_expert_base": (num_chunks + 1, experts),
        "recv_chunk_start": (world, plan.max_chunks + 1),
        "recv_src_tokens": (world,),
        "recv_rank_prefix": (world,),
        "expert_layout": (3, plan.experts_per_rank),
        "staged_rows": (world, plan.max_tokens, plan.meta_stride),
        "token_node_pos": (num_tokens, nodes) if across else (0,),
        "send_chunk_node_start": (plan.max_chunks + 1, nodes) if across else (0,),
        "recv_net_chunk_start": (nodes, plan.max_chunks + 1) if across else (0,),
        "fwd_rows": (nodes, plan.max_tokens, plan.ranks_per_node) if across else (0,),
    }


@functools.lru_cache(maxsize=256)
def state_layout(plan: Plan, num_tokens: int, topk: int) -> tuple[int, dict]:
    """(int64 elements of ``state``, {part: (shape, strides, offset in int32 elements)}). Each
    part starts on a 16-byte boundary, as Triton's pointer specialisation expects. Cached:
    every call needs it, and a dispatch is latency-bound at small batches."""
    parts = {}
    offset = 2 * ceil_div(INFO_WORDS + plan.experts_per_rank, 2) * 2  # int32s after int64s
    for name, shape in _int_parts(plan, num_tokens, topk).items():
        strides = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
        parts[name] = (shape, strides, offset)
        offset += ceil_div(math.prod(shape), 4) * 4
    return offset // 2, parts


def handle_size(plan: Plan, num_tokens: int, topk: int) -> int:
    """Elements of a handle's ``state`` (int64) for ``num_tokens`` tokens of ``topk`` slots."""
    return state_layout(plan, num_tokens, topk)[0]


def make_handle(
    plan: Plan,
    topk_idx: torch.Tensor,
    state: torch.Tensor,
    num_recv_rows: int,
    max_recv_tokens: int | None,
    parts: dict | None = None,
) -> DispatchHandle:
    """The handle whose parts are views of ``state`` (see handle_size); ``parts``: their layout,
    where the caller has looked it up already."""
    num_tokens, topk = topk_idx.shape
    return DispatchHandle(
        num_tokens=num_tokens,
        topk=topk,
        num_recv_rows=num_recv_rows,
        max_recv_tokens=max_recv_tokens,
        topk_idx=topk_idx,
        state=state,
        tokens_per_expert=state[INFO_WORDS : INFO_WORDS + plan.experts_per_rank],
        parts=parts if parts is not None else state_layout(plan, num_tokens, topk)[1],
        token_rows=plan.token_rows,
    )


def check_handle(handle, device: torch.device) -> None:
    """``handle``: a DispatchHandle of a Buffer on ``device``."""
    if not isinstance(handle, DispatchHandle) or handle.state.device != device:
        raise ValueError(f"handle must be a DispatchHandle of this Buffer, got {describe(handle)}")
