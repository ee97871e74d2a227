"""DeepEP V1's ``Buffer`` (normal and low-latency modes) over ``hybrid_ep_triton.Buffer``.

The calls keep DeepEP's signatures, outputs and meanings; docs/deep_ep.md lists every
difference. In brief: the Buffers behind it are sized at the first call and grown when a call
needs more tokens (``_sizing``); a normal dispatch with ``topk_idx`` runs two Buffer dispatches,
the token rows (``expand=False``) and a [T, 2K + 2] float32 row of metadata per token (its
expert ids and weights, source rank and index), because DeepEP's ``recv_topk_idx`` keeps each
slot's position (-1 where the expert lives on another rank) and its combine sums per-slot
weights, which a Buffer's token rows (local ids first, then -1) and combine (of [N, H] rows) do
not give.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist
import triton

from .. import Buffer as _HepBuffer
from ..buffer import DEFAULT_TIMEOUT_S
from ..ops.reserved import ReservedHeap
from ..runtime.checks import (
    MAX_LOW_LATENCY_TOKENS,
    check_mask_out,
    check_maskable,
    ranks_per_host,
)
from ..runtime.planner import ceil_div
from ._sizing import Sized, gather, round_up
from .utils.event import EventHandle, EventOverlap

topk_idx_t = torch.int64
# DeepEP's constants behind its size hints (csrc/kernels/legacy/compiled.cuh, internode.cu).
_NVL_PEERS = 8
_ALIGNMENT = 128
_SOURCE_META_BYTES = 8
_MAX_TOPK_HINT = 128
_MAX_SCALES_HINT = 128
_FP8_GROUP = 128


class Config:
    """DeepEP's performance configuration of a normal-mode call.

    Accepted and ignored by the calls (this library's kernels take their parameters from its
    tuning cache); the size hints are DeepEP's, for clients that size DeepEP buffers with them.

    Args:
        num_sms: SMs of DeepEP's kernels.
        num_max_nvl_chunked_send_tokens: DeepEP's NVLink send chunk, in tokens.
        num_max_nvl_chunked_recv_tokens: DeepEP's NVLink receive buffer, in tokens.
        num_max_rdma_chunked_send_tokens: DeepEP's RDMA send chunk, in tokens.
        num_max_rdma_chunked_recv_tokens: DeepEP's RDMA receive buffer, in tokens.
    """

    def __init__(
        self,
        num_sms: int = 20,
        num_max_nvl_chunked_send_tokens: int = 6,
        num_max_nvl_chunked_recv_tokens: int = 256,
        num_max_rdma_chunked_send_tokens: int = 6,
        num_max_rdma_chunked_recv_tokens: int = 256,
    ):
        self.num_sms = num_sms
        self.num_max_nvl_chunked_send_tokens = num_max_nvl_chunked_send_tokens
        self.num_max_nvl_chunked_recv_tokens = num_max_nvl_chunked_recv_tokens
        self.num_max_rdma_chunked_send_tokens = num_max_rdma_chunked_send_tokens
        # DeepEP rounds the RDMA receive buffer up to a multiple of the send chunk.
        self.num_max_rdma_chunked_recv_tokens = round_up(
            num_max_rdma_chunked_recv_tokens, num_max_rdma_chunked_send_tokens
        )

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """DeepEP's NVLink buffer bytes for rows of ``hidden_bytes`` over ``num_ranks``."""
        rdma_ranks = max(num_ranks // _NVL_PEERS, 1)
        nvl_ranks = min(num_ranks, _NVL_PEERS)
        slots = self.num_sms // 2 * nvl_ranks
        tokens = slots * self.num_max_nvl_chunked_recv_tokens
        per_token = hidden_bytes + _SOURCE_META_BYTES + _MAX_TOPK_HINT * (8 + 4)
        per_token += _MAX_SCALES_HINT * 4
        return round_up(slots * (2 * rdma_ranks + 3) * 4 + tokens * per_token, _ALIGNMENT)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """DeepEP's RDMA buffer bytes (0 within one node of at most 8 ranks)."""
        if num_ranks <= _NVL_PEERS:
            return 0
        slots = self.num_sms // 2 * (num_ranks // _NVL_PEERS)
        tokens = slots * self.num_max_rdma_chunked_recv_tokens
        per_token = hidden_bytes + _SOURCE_META_BYTES + _MAX_TOPK_HINT * (8 + 4)
        per_token += _MAX_SCALES_HINT * 4 + 16
        return round_up(slots * (_NVL_PEERS * 2 + 2) * 2 * 4 + tokens * per_token * 2, _ALIGNMENT)

    def __repr__(self) -> str:
        nvl = self.num_max_nvl_chunked_send_tokens, self.num_max_nvl_chunked_recv_tokens
        rdma = self.num_max_rdma_chunked_send_tokens, self.num_max_rdma_chunked_recv_tokens
        return f"Config(num_sms={self.num_sms}, nvl chunks {nvl}, rdma chunks {rdma})"


def get_low_latency_rdma_size_hint(
    num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int
) -> int:
    """DeepEP's low-latency RDMA buffer bytes (two send, receive and signalling areas, sized in
    BF16); ``num_ranks`` does not enter DeepEP's formula."""
    tokens, scales = num_max_dispatch_tokens_per_rank, hidden // _FP8_GROUP
    dispatch_message = 16 + max(hidden * 2, hidden + scales * 4)
    combine_message = scales * 4 + hidden * 2
    send = max(tokens * dispatch_message, num_experts * tokens * combine_message)
    receive = num_experts * tokens * max(dispatch_message, combine_message)
    signalling = round_up(num_experts * 4, _ALIGNMENT)
    total = 2 * (send + receive + signalling)
    return (total + _ALIGNMENT) // _ALIGNMENT * _ALIGNMENT


# DeepEP's recommended configurations by group size (deep_ep/buffers/legacy.py), as
# (nvl send, nvl recv, rdma send, rdma recv) tokens.
_DISPATCH_CONFIGS = {
    2: (24, 256, 6, 128),
    4: (6, 256, 6, 128),
    8: (6, 256, 6, 128),
    16: (36, 288, 20, 128),
    24: (32, 288, 8, 128),
    32: (32, 288, 8, 128),
    48: (32, 288, 8, 128),
    64: (32, 288, 8, 128),
    96: (20, 480, 12, 128),
    128: (20, 560, 12, 128),
    144: (32, 720, 12, 128),
    160: (28, 720, 12, 128),
}
_COMBINE_CONFIGS = {
    2: (10, 256, 6, 128),
    4: (9, 256, 6, 128),
    8: (4, 256, 6, 128),
    16: (4, 288, 12, 128),
    24: (1, 288, 8, 128),
    32: (1, 288, 8, 128),
    48: (1, 288, 8, 128),
    64: (1, 288, 8, 128),
    96: (1, 480, 8, 128),
    128: (1, 560, 8, 128),
    144: (2, 720, 8, 128),
    160: (2, 720, 8, 128),
}


class DispatchHandle(tuple):
    """A normal dispatch's handle: DeepEP's intranode 6-tuple, (rank_prefix_matrix,
    channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx, is_token_in_rank,
    send_head), with what this package's calls need as attributes.

    rank_prefix_matrix [W, W] int32: column r (this rank) holds the rows received from ranks
    0..i (DeepEP's meaning); the other columns are -1 (DeepEP fills them from its count
    exchange, which this package does not make). recv_src_idx [N] int32: each row's source token
    index (-1 on rows past the valid count). is_token_in_rank [T, W] bool: this rank's tokens.
    The channel matrices and send_head describe DeepEP's channels: None here.
    """

    tokens: object  # the token rows' Buffer handle
    tokens_buffer: _HepBuffer
    meta: object  # the metadata rows' Buffer handle
    meta_buffer: _HepBuffer
    topk: int  # K of the dispatch's topk_idx (0: none)

    def __new__(cls, parts, tokens, tokens_buffer, meta, meta_buffer, topk):
        handle = super().__new__(cls, parts)
        handle.tokens, handle.tokens_buffer = tokens, tokens_buffer
        handle.meta, handle.meta_buffer, handle.topk = meta, meta_buffer, topk
        return handle


class LowLatencyHandle(tuple):
    """A low-latency dispatch's handle: DeepEP's 5-tuple (src_info, layout_range,
    num_max_dispatch_tokens_per_rank, hidden, num_experts), which clients may unpack, with this
    library's own handle (``hybrid_ep``, its 6th field token_slots included) and Buffer as
    attributes. A 5-tuple rebuilt from the parts lacks them: combine then raises ValueError."""

    hybrid_ep: object
    buffer: _HepBuffer

    def __new__(cls, inner, buffer):
        handle = super().__new__(cls, tuple(inner)[:5])
        handle.hybrid_ep, handle.buffer = inner, buffer
        return handle


@dataclass
class _Routing:
    """What a normal dispatch routes by: [T, K'] global expert ids (K' = W without topk_idx:
    expert r * L for every rank r the token goes to), K of the caller's topk_idx (0 without)
    and E."""

    slots: torch.Tensor
    topk: int
    experts: int


class Buffer:
    """DeepEP V1's communication buffer for expert parallelism (normal and low-latency modes).

    Collective, like DeepEP's: every rank of ``group`` makes one (a host all-gather of host
    names). The Buffers that move data are made at the first call of each mode, which gives the
    sizes DeepEP's constructor does not (hidden size, dtype, experts, token counts): see
    docs/deep_ep.md, "Sizes".

    Args:
        group: the torch.distributed group of the expert-parallel ranks (NCCL, or gloo for CPU
            ranks and ranks sharing a GPU).
        num_nvl_bytes: DeepEP's NVLink buffer bytes: recorded; no Buffer is sized from it.
        num_rdma_bytes: DeepEP's RDMA buffer bytes: with low_latency_mode, the low-latency area
            holds as many tokens as DeepEP's get_low_latency_rdma_size_hint fits in it.
        low_latency_mode: allow the low-latency calls (DeepEP asserts it there; so here).
        num_qps_per_rank: RDMA queue pairs of DeepEP's: ignored (NVSHMEM's own transport).
        allow_nvlink_for_low_latency_mode: ignored (peers of a node always use NVLink here).
        allow_mnnvl: ignored (nodes are hosts, or ranks_per_node of this library).
        explicitly_destroy: whether ``destroy()`` frees the buffers (DeepEP: required to call it).
        enable_shrink: DeepEP's rank masking: a peer that does not answer a low-latency call
            within the timeout is masked, and the mask calls (low_latency_*_mask_buffer) work.
        comm: an mpi4py communicator instead of group: unsupported (ValueError if given).
        timeout_s: this library's, not DeepEP's: seconds any wait on another rank may last
            (float > 0) before TimeoutError, or, with enable_shrink, before that rank is masked
            (Buffer's timeout_s: a serving engine takes it well under a second).
    """

    num_sms: int = 20

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        num_nvl_bytes: int = 0,
        num_rdma_bytes: int = 0,
        low_latency_mode: bool = False,
        num_qps_per_rank: int = 24,
        allow_nvlink_for_low_latency_mode: bool = True,
        allow_mnnvl: bool = False,
        explicitly_destroy: bool = False,
        enable_shrink: bool = False,
        comm=None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ):
        if group is None:
            if comm is not None:
                raise ValueError("an mpi4py comm is not supported: pass a torch.distributed group")
            raise ValueError("Either 'group' or 'comm' must be provided.")
        self.group = group
        self.rank = dist.get_rank(group)
        self.group_size = dist.get_world_size(group)
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.explicitly_destroy = explicitly_destroy
        self.enable_shrink = enable_shrink
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = float(timeout_s)
        self.ranks_per_node = ranks_per_host(gather(group, socket.gethostname()))
        self._normal = Sized(group, self._make_normal)
        self._normal_shape = None  # (hidden, dtype, experts, device) of the normal Buffers
        self._low_latency: _HepBuffer | None = None
        # The low-latency Buffer's heap, reserved here as DeepEP allocates its RDMA buffer: the
        # first low-latency call, which makes the Buffer in it, then waits for no rank on the
        # host (one may be gone by then: enable_shrink).
        self._reserved = None
        if low_latency_mode and num_rdma_bytes > 0:
            nbytes = num_rdma_bytes + _BESIDE_LOW_LATENCY_BYTES
            device = _constructor_device()
            self._reserved = ReservedHeap(group, nbytes, device, self.ranks_per_node)
        self._masked = torch.zeros(self.group_size, dtype=torch.int32, device="cpu")  # (until then)
        self._retired: list[_HepBuffer] = []
        self._join: torch.cuda.Stream | None = None

    # -- DeepEP's static and small calls ----------------------------------------------------

    @staticmethod
    def is_sm90_compiled() -> bool:
        """True: FP8 rows and every format this library moves need no separate build."""
        return True

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Record DeepEP's SM count for the recommended configs (even, as DeepEP asserts); this
        library's kernels take their own (see ``Config``)."""
        if new_num_sms % 2:
            raise ValueError(f"The SM count must be even, got {new_num_sms}")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        """An event on the current CUDA stream (none on CPU ranks), for previous_event."""
        return EventOverlap(EventHandle())

    @staticmethod
    def get_low_latency_rdma_size_hint(
        num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int
    ) -> int:
        """DeepEP's formula (see the module function of this name)."""
        return get_low_latency_rdma_size_hint(
            num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts
        )

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """DeepEP's recommended dispatch Config for ``num_ranks`` (ValueError for others)."""
        return _config(_DISPATCH_CONFIGS, num_ranks)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """DeepEP's recommended combine Config for ``num_ranks`` (ValueError for others)."""
        return _config(_COMBINE_CONFIGS, num_ranks)

    def get_comm_stream(self):
        """Unsupported: each underlying Buffer runs async calls on a stream of its own."""
        raise ValueError(
            "get_comm_stream is not supported: calls with async_finish run on each underlying "
            "hybrid_ep_triton.Buffer's own stream, which it does not expose"
        )

    def get_local_buffer_tensor(self, *args, **kwargs):
        """Unsupported: there is no raw DeepEP buffer to view."""
        raise ValueError("get_local_buffer_tensor is not supported (no raw DeepEP buffer)")

    # -- rank masking (enable_shrink): the low-latency calls skip masked ranks --------------

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Mask (``mask``) or unmask ``rank_to_mask``, another rank (Buffer.update_mask)."""
        self._check_shrink()
        check_maskable(rank_to_mask, self.rank, self.group_size)
        self._masked[rank_to_mask] = int(bool(mask))
        if self._low_latency is not None:
            self._low_latency.update_mask(rank_to_mask, bool(mask))

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        """Write int32 [num_ranks], 1 where a rank is masked, into ``mask_status``."""
        self._check_shrink()
        if self._low_latency is not None:
            self._low_latency.query_mask(mask_status)
        else:
            check_mask_out(mask_status, self.group_size, None)
            mask_status.copy_(self._masked)

    def low_latency_clean_mask_buffer(self) -> None:
        """Unmask every rank."""
        self._check_shrink()
        self._masked.zero_()
        if self._low_latency is not None:
            self._low_latency.clean_mask()

    def _check_shrink(self) -> None:
        if not self.enable_shrink:
            raise ValueError("rank masking needs Buffer(..., enable_shrink=True), as DeepEP's")

    def destroy(self) -> None:
        """Free every buffer (collective). DeepEP requires explicitly_destroy=True; so here."""
        if not self.explicitly_destroy:
            raise ValueError("`explicitly_destroy` flag must be set")
        self._normal.destroy()
        for buffer in [*self._retired, self._low_latency]:
            if buffer is not None:
                buffer.destroy()
        if self._reserved is not None:
            self._reserved.release(self.timeout_s)
        self._retired, self._low_latency, self._reserved = [], None, None

    # -- normal mode -----------------------------------------------------------------------

    def get_dispatch_layout(
        self,
        topk_idx: torch.Tensor,
        num_experts: int,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        """What a dispatch sends where; local (no communication), on the current stream.

        Args:
            topk_idx: [T, K] int64 (or int32) global expert ids, -1 for an unused slot.
            num_experts: E, a multiple of the group size.
            previous_event: an event the current stream waits for first, or None.
            async_finish: also return an event of the outputs' completion.
            allocate_on_comm_stream: accepted (the outputs are made on the current stream).

        Returns:
            num_tokens_per_rank [W] int32, num_tokens_per_rdma_rank [nodes] int32 (None within
            one node), num_tokens_per_expert [E] int32, is_token_in_rank [T, W] bool, event.
        """
        _wait(previous_event)
        experts_per_rank = self._experts_per_rank(num_experts)
        is_token_in_rank = _token_ranks(topk_idx, experts_per_rank, self.group_size)
        num_tokens_per_rank = is_token_in_rank.sum(0, dtype=torch.int32)
        valid = topk_idx[topk_idx >= 0].long()
        num_tokens_per_expert = torch.bincount(valid, minlength=num_experts).int()
        per_node = None
        nodes = self.group_size // self.ranks_per_node
        if nodes > 1:
            in_node = is_token_in_rank.view(-1, nodes, self.ranks_per_node).any(2)
            per_node = in_node.sum(0, dtype=torch.int32)
        event = EventOverlap(EventHandle()) if async_finish else EventOverlap(None)
        return num_tokens_per_rank, per_node, num_tokens_per_expert, is_token_in_rank, event

    def dispatch(
        self,
        x,
        handle: DispatchHandle | None = None,
        num_tokens_per_rank: torch.Tensor | None = None,
        num_tokens_per_rdma_rank: torch.Tensor | None = None,
        is_token_in_rank: torch.Tensor | None = None,
        num_tokens_per_expert: torch.Tensor | None = None,
        topk_idx: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        expert_alignment: int = 1,
        num_worst_tokens: int = 0,
        config: Config | None = None,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        """Send each token to the ranks of its experts, one row per (token, rank). Collective.

        Args:
            x: [T, H] rows (the dtype of the first call's: bf16 for DeepEP), or an FP8 pair
                (values [T, H] float8_e4m3fn, scales [T, H / 128] float32, any strides).
            handle: a dispatch's handle: send ``x`` along its routing (a cached dispatch).
            num_tokens_per_rank: get_dispatch_layout's; not read (the Buffer counts itself).
            num_tokens_per_rdma_rank: get_dispatch_layout's; not read.
            is_token_in_rank: get_dispatch_layout's [T, W]: routes the tokens without topk_idx;
                with topk_idx, not read (it must be the one get_dispatch_layout gave for it).
            num_tokens_per_expert: [E] int32, get_dispatch_layout's; read without topk_idx
                (the received counts then come from their sum over the ranks).
            topk_idx: [T, K] int64 (or int32) global expert ids, -1 unused, or None.
            topk_weights: [T, K] float32, or None (with topk_idx: zeros are sent).
            expert_alignment: the received counts are rounded up to a multiple of it.
            num_worst_tokens: 0, or N: recv_x has N rows and nothing waits on the host (rows
                past the received ones are zero, their recv_topk_idx -1); the counts list is
                then empty. Rows beyond N are dropped.
            config: a Config: ignored.
            previous_event: the call starts after it (else after the current stream's work).
            async_finish: run on the Buffers' streams; the event completes with the call.
            allocate_on_comm_stream: accepted (outputs of async calls are the Buffers' own).

        Returns:
            recv_x (x's kind, rows by source rank, then source token index),
            recv_topk_idx [N, K] int64 (slot k: the local id of the token's expert k, -1 where
            that expert is elsewhere) or None, recv_topk_weights [N, K] float32 (0 where -1) or
            None, num_recv_tokens_per_expert_list (list of L ints, aligned), handle, event. A
            cached dispatch returns recv_x, None, None, None, None, event.
        """
        _wait_if_sync(previous_event, async_finish)
        prior = _event_of(previous_event) if async_finish else None
        with torch.no_grad():
            rows = _rows(x)
            if handle is not None:
                return self._cached_dispatch(
                    rows, handle, topk_idx, topk_weights, prior, async_finish
                )
            routing = self._routing(
                _values(rows), topk_idx, is_token_in_rank, num_tokens_per_expert
            )
            num_experts = routing.experts
            shape = (_values(rows).shape[1], _dtype_of(rows), num_experts, _values(rows).device)
            self._size_normal(shape, _values(rows).shape[0], num_worst_tokens)
            meta_rows = _meta_rows(routing.slots, topk_weights, routing.topk, self.rank)
            worst = num_worst_tokens or None
            parts = self._normal.run(
                _values(rows).shape[0],
                lambda: self._dispatch_both(rows, meta_rows, routing, worst, prior, async_finish),
                growable=worst is None,
            )
            return self._dispatch_outputs(
                parts,
                routing,
                is_token_in_rank,
                num_tokens_per_expert,
                expert_alignment,
                worst,
                async_finish,
            )

    def combine(
        self,
        x: torch.Tensor,
        handle: DispatchHandle,
        topk_weights: torch.Tensor | None = None,
        bias=None,
        config: Config | None = None,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        """Sum each token's rows from every rank it went to (no weights). Collective.

        Args:
            x: [N, H] rows in recv_x's order, the dtype of the dispatches' rows.
            handle: the dispatch's handle.
            topk_weights: [N, K] float32, or None: also summed per token and slot.
            bias: None, a [T, H] tensor or a pair of them, added to each token's sum.
            config: a Config: ignored.
            previous_event, async_finish, allocate_on_comm_stream: as for ``dispatch``.

        Returns:
            combined_x [T, H] (the sum in fp32, rounded to x's dtype, then each bias added in
            fp32 and rounded again), combined_topk_weights [T, K] float32 or None, event.
        """
        _wait_if_sync(previous_event, async_finish)
        prior = _event_of(previous_event) if async_finish else None
        if not isinstance(handle, DispatchHandle):
            raise ValueError(f"handle must be a dispatch's handle of this Buffer, got {handle!r}")
        if topk_weights is not None and handle.topk != topk_weights.shape[-1]:
            raise ValueError(
                f"topk_weights must have the dispatch's {handle.topk} slots, got "
                f"{tuple(topk_weights.shape)}"
            )
        with torch.no_grad():
            outputs = handle.tokens_buffer.combine(
                x, handle.tokens, previous_event=prior, async_finish=async_finish
            )
            combined, events = _split_event(outputs, async_finish)
            combined_weights = None
            if topk_weights is not None:
                meta = torch.zeros(
                    topk_weights.shape[0],
                    2 * handle.topk + 2,
                    dtype=torch.float32,
                    device=topk_weights.device,
                )
                meta[:, handle.topk : 2 * handle.topk] = topk_weights
                outputs = handle.meta_buffer.combine(
                    meta, handle.meta, previous_event=prior, async_finish=async_finish
                )
                summed, more = _split_event(outputs, async_finish)
                events += more
                combined_weights = summed[:, handle.topk : 2 * handle.topk]
            if bias is not None:
                # The bias is added on the current stream, after the sums.
                for event in events:
                    torch.cuda.current_stream().wait_event(event)
                combined = _add_bias(combined, bias)
                if async_finish:
                    return combined, combined_weights, EventOverlap(EventHandle())
        return combined, combined_weights, self._event(events, async_finish)

    # -- low-latency mode ------------------------------------------------------------------

    def clean_low_latency_buffer(
        self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int
    ) -> None:
        """Nothing to clean (flags carry sequence numbers; the normal mode has Buffers of its
        own): checks low_latency_mode, as DeepEP does, and once the low-latency Buffer exists
        is its barrier of the live ranks (Buffer.clean_low_latency_buffer)."""
        self._check_low_latency_mode()
        if self._low_latency is not None:
            self._low_latency.clean_low_latency_buffer(
                min(num_max_dispatch_tokens_per_rank, self._low_latency.low_latency_tokens),
                hidden,
                num_experts,
            )

    def low_latency_dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        num_max_dispatch_tokens_per_rank: int,
        num_experts: int,
        cumulative_local_expert_recv_stats: torch.Tensor | None = None,
        dispatch_wait_recv_cost_stats: torch.Tensor | None = None,
        use_fp8: bool = True,
        round_scale: bool = False,
        use_ue8m0: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
        **hybrid_ep_branch_args,
    ):
        """DeepEP's low-latency dispatch (``hybrid_ep_triton.Buffer.low_latency_dispatch``).

        Args:
            x: [T, H] bf16, T <= num_max_dispatch_tokens_per_rank.
            topk_idx: [T, K] int64 global expert ids, -1 unused.
            num_max_dispatch_tokens_per_rank: M', the same on every rank and call of one size.
            num_experts: E.
            cumulative_local_expert_recv_stats: [L] int32 each call adds its counts to, or None.
            dispatch_wait_recv_cost_stats: DeepEP's per-rank wait times: accepted, not updated.
            use_fp8, round_scale, use_ue8m0: the FP8 format (DeepEP's rules).
            async_finish: return an event of the call's completion.
            return_recv_hook: send only; hook() receives.
            hybrid_ep_branch_args: the hybrid-ep branch's extras: unsupported when set.

        Returns:
            recv_x (or (values, scales)), recv_count [L] int32, handle (a 5-tuple), event, hook.
        """
        _refuse_extras("low_latency_dispatch", hybrid_ep_branch_args)
        with torch.no_grad():
            buffer = self._low_latency_buffer(x, num_max_dispatch_tokens_per_rank, num_experts)
            recv_x, count, inner, event, hook = buffer.low_latency_dispatch(
                x,
                topk_idx,
                num_max_dispatch_tokens_per_rank,
                num_experts,
                cumulative_local_expert_recv_stats=cumulative_local_expert_recv_stats,
                use_fp8=use_fp8,
                round_scale=round_scale,
                use_ue8m0=use_ue8m0,
                async_finish=async_finish,
                return_recv_hook=return_recv_hook,
            )
        handle = LowLatencyHandle(inner, buffer)
        return recv_x, count, handle, self._event([event] if event else [], async_finish), hook

    def low_latency_combine(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        handle: LowLatencyHandle,
        use_logfmt: bool = False,
        zero_copy: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
        out: torch.Tensor | None = None,
        combine_wait_recv_cost_stats: torch.Tensor | None = None,
        **hybrid_ep_branch_args,
    ):
        """DeepEP's low-latency combine (``hybrid_ep_triton.Buffer.low_latency_combine``).

        Args:
            x: [L, W * M', H] bf16 expert outputs in recv_x's rows.
            topk_idx, topk_weights: the dispatch's [T, K] ids and float32 weights.
            handle: the dispatch's handle.
            use_logfmt: DeepEP's 10-bit transfer format: ignored (rows travel in bf16, exact).
            zero_copy: the experts wrote into get_next_low_latency_combine_buffer's buffer,
                which is read (x is not).
            async_finish, return_recv_hook: as for ``low_latency_dispatch``.
            out: [T, H] bf16 to write into, or None.
            combine_wait_recv_cost_stats: DeepEP's per-rank wait times: accepted, not updated.
            hybrid_ep_branch_args: the hybrid-ep branch's extras: unsupported when set.

        Returns:
            combined_x [T, H], event, hook.
        """
        _refuse_extras("low_latency_combine", hybrid_ep_branch_args)
        buffer, inner = _low_latency_parts(handle)
        if zero_copy:
            # DeepEP reads the buffer the experts wrote into, whatever x is (its own test
            # passes the rows it also copied there); the Buffer takes that buffer as x.
            x = buffer.get_next_low_latency_combine_buffer(inner)
        with torch.no_grad():
            combined, event, hook = buffer.low_latency_combine(
                x,
                topk_idx,
                topk_weights,
                inner,
                zero_copy=zero_copy,
                async_finish=async_finish,
                return_recv_hook=return_recv_hook,
                out=out,
            )
        return combined, self._event([event] if event else [], async_finish), hook

    def get_next_low_latency_combine_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        """[L, W * M', H] bf16 in the heap, for the experts' outputs of the next combine."""
        buffer, inner = _low_latency_parts(handle)
        return buffer.get_next_low_latency_combine_buffer(inner)

    # -- internals -------------------------------------------------------------------------

    def _experts_per_rank(self, num_experts: int) -> int:
        if num_experts % self.group_size:
            raise ValueError(
                f"num_experts must be a multiple of the group size {self.group_size}, got "
                f"{num_experts}"
            )
        return num_experts // self.group_size

    def _routing(self, x, topk_idx, is_token_in_rank, num_tokens_per_expert):
        """The slots to route by, K and E (see _Routing)."""
        if topk_idx is not None:
            if num_tokens_per_expert is None:
                raise ValueError("num_tokens_per_expert (get_dispatch_layout's) is required")
            num_experts = num_tokens_per_expert.numel()
            routing = _Routing(topk_idx, topk_idx.shape[1], num_experts)
        else:
            if is_token_in_rank is None or num_tokens_per_expert is None:
                raise ValueError(
                    "a dispatch without topk_idx routes by is_token_in_rank and needs "
                    "num_tokens_per_expert (get_dispatch_layout's)"
                )
            num_experts = num_tokens_per_expert.numel()
            first_experts = torch.arange(self.group_size, device=x.device)
            first_experts = first_experts * self._experts_per_rank(num_experts)
            slots = torch.where(is_token_in_rank.to(x.device), first_experts, -1)
            routing = _Routing(slots, 0, num_experts)
        self._experts_per_rank(num_experts)
        return routing

    def _size_normal(self, shape, num_tokens: int, num_worst_tokens: int) -> None:
        """Size the normal Buffers for rows of ``shape`` (hidden, dtype, experts, device): at
        the first dispatch, and again (new Buffers) when a dispatch's rows differ from the
        last ones' (DeepEP takes any per call; every rank passes the same)."""
        if shape != self._normal_shape:
            self._normal.reset()
            self._normal_shape = shape
        at_least = ceil_div(num_worst_tokens, self.group_size)
        self._normal.size_for(num_tokens, at_least)

    def _make_normal(self, kind, capacity: int) -> _HepBuffer:
        """The normal mode's Buffer of ``kind`` ("tokens", or the width of metadata rows)."""
        hidden, dtype, experts, device = self._normal_shape
        if kind != "tokens":
            hidden, dtype = kind, torch.float32
        return _HepBuffer(
            self.group,
            hidden_size=hidden,
            max_tokens_per_rank=capacity,
            num_experts=experts,
            dtype=dtype,
            expand=False,
            ranks_per_node=self.ranks_per_node,
            device=device,
            timeout_s=self.timeout_s,
        )

    def _dispatch_both(self, rows, meta_rows, routing, worst, prior, async_finish):
        """The token rows' dispatch, then the metadata rows' (the same routing, so the same
        row order); their outputs (with their events when async_finish)."""
        tokens = self._normal.buffer("tokens")
        meta = self._normal.buffer(meta_rows.shape[1])
        kwargs = dict(max_recv_tokens=worst, previous_event=prior, async_finish=async_finish)
        token_out = tokens.dispatch(rows, routing.slots, **kwargs)
        meta_out = meta.dispatch(meta_rows, routing.slots, **kwargs)
        return tokens, token_out, meta, meta_out

    def _dispatch_outputs(
        self,
        parts,
        routing,
        is_token_in_rank,
        num_tokens_per_expert,
        alignment,
        worst,
        async_finish,
    ):
        tokens, token_out, meta, meta_out = parts
        (recv_x, _, _, tokens_per_expert, token_handle), events = _split_event(
            token_out, async_finish
        )
        (recv_meta, _, _, _, meta_handle), more = _split_event(meta_out, async_finish)
        events += more
        if async_finish and events:
            # The decoding below reads the metadata rows on the current stream.
            torch.cuda.current_stream().wait_event(events[-1])
        topk = routing.topk
        local_experts = tokens.num_experts // self.group_size
        ids = recv_meta[:, :topk].round().long() - 1
        first = self.rank * local_experts
        is_local = (ids >= first) & (ids < first + local_experts)
        recv_topk_idx = recv_topk_weights = None
        if topk:
            recv_topk_idx = torch.where(is_local, ids - first, -1)
            recv_topk_weights = torch.where(is_local, recv_meta[:, topk : 2 * topk], 0.0)
        src_rank = recv_meta[:, 2 * topk].round().long() - 1
        recv_src_idx = (recv_meta[:, 2 * topk + 1].round() - 1).int()
        if worst is None:
            if topk:
                counts = tokens_per_expert
            else:
                counts = self._counts_from(num_tokens_per_expert, local_experts)
            counts = round_up(counts, alignment).tolist()
        else:
            counts = []
        rank_prefix = torch.full(
            (self.group_size, self.group_size), -1, dtype=torch.int32, device=recv_src_idx.device
        )
        received = torch.bincount(src_rank[src_rank >= 0], minlength=self.group_size)
        rank_prefix[:, self.rank] = received.cumsum(0).int()
        if is_token_in_rank is None:
            is_token_in_rank = _token_ranks(routing.slots, local_experts, self.group_size)
        parts = (rank_prefix, None, None, recv_src_idx, is_token_in_rank, None)
        handle = DispatchHandle(parts, token_handle, tokens, meta_handle, meta, topk)
        return (
            recv_x,
            recv_topk_idx,
            recv_topk_weights,
            counts,
            handle,
            self._event(events, async_finish),
        )

    def _counts_from(self, num_tokens_per_expert: torch.Tensor, local_experts: int):
        """This rank's received count per local expert: the sum of every rank's
        num_tokens_per_expert (a collective; a dispatch without topk_idx only)."""
        on_device = dist.get_backend(self.group) == "nccl"
        counts = num_tokens_per_expert.to(torch.int64)
        counts = counts if on_device else counts.cpu()
        dist.all_reduce(counts, group=self.group)
        first = self.rank * local_experts
        return counts[first : first + local_experts].cpu()

    def _cached_dispatch(self, rows, handle, topk_idx, topk_weights, prior, async_finish):
        if topk_idx is not None or topk_weights is not None:
            raise ValueError("a cached dispatch (with handle) takes no topk_idx or topk_weights")
        if not isinstance(handle, DispatchHandle):
            raise ValueError(f"handle must be a dispatch's handle of this Buffer, got {handle!r}")
        outputs = handle.tokens_buffer.dispatch(
            rows, handle=handle.tokens, previous_event=prior, async_finish=async_finish
        )
        (recv_x, *_), events = _split_event(outputs, async_finish)
        return recv_x, None, None, None, None, self._event(events, async_finish)

    def _check_low_latency_mode(self) -> None:
        if not self.low_latency_mode:
            raise ValueError("the low-latency calls need a Buffer made with low_latency_mode=True")

    def _low_latency_buffer(self, x, num_max_dispatch_tokens_per_rank, num_experts):
        """The low-latency Buffer, made (or made again, larger) when a call needs it. Every rank
        passes the same M', hidden size and E (DeepEP's rule), so each decides alike."""
        self._check_low_latency_mode()
        buffer = self._low_latency
        hidden = x.shape[-1]
        if buffer is not None and (
            buffer.low_latency_tokens >= num_max_dispatch_tokens_per_rank
            and (buffer.hidden_size, buffer.num_experts, buffer.dtype)
            == (hidden, num_experts, x.dtype)
        ):
            return buffer
        if buffer is not None:
            self._retired.append(buffer)
        tokens = max(
            num_max_dispatch_tokens_per_rank,
            _tokens_that_fit(self.num_rdma_bytes, hidden, self.group_size, num_experts),
        )
        self._low_latency = _HepBuffer(
            self.group,
            hidden_size=hidden,
            max_tokens_per_rank=0,
            num_experts=num_experts,
            dtype=x.dtype,
            ranks_per_node=self.ranks_per_node,
            device=x.device,
            low_latency_tokens=tokens,
            mask_failed_ranks=self.enable_shrink,
            timeout_s=self.timeout_s,
            heap=self._reserved,
        )
        for rank in self._masked.nonzero().flatten().tolist():
            self._low_latency.update_mask(rank, True)
        return self._low_latency

    def _event(self, events: list, async_finish: bool) -> EventOverlap:
        """DeepEP's event output: with async_finish one event that completes when every one of
        ``events`` has (none: CPU ranks, complete already); else no event."""
        if not async_finish:
            return EventOverlap(None)
        if len(events) <= 1:
            return EventOverlap(EventHandle.of(events[0] if events else None))
        if self._join is None:
            self._join = torch.cuda.Stream()
        for event in events:
            self._join.wait_event(event)
        return EventOverlap(EventHandle.of(self._join.record_event()))


def _config(table: dict, num_ranks: int) -> Config:
    if num_ranks not in table:
        raise ValueError(f"Unsupported number of EP ranks: {num_ranks}")
    return Config(Buffer.num_sms, *table[num_ranks])


# What a low-latency Buffer's heap holds beside the area DeepEP's size hint covers (the
# mask, the normal mode's flags and a token row per rank): tens of KB for the sizes of
# DeepEP's tests, up to a few MB across many nodes, where the hint's margin over this
# library's area is larger still.
_BESIDE_LOW_LATENCY_BYTES = 8 << 20


def _constructor_device() -> torch.device:
    """Where DeepEP's constructor allocates: the current CUDA device (the CPU for CPU ranks,
    whose kernels run in Triton's interpreter)."""
    if triton.knobs.runtime.interpret:
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _tokens_that_fit(num_rdma_bytes: int, hidden: int, num_ranks: int, num_experts: int) -> int:
    """The most tokens M with DeepEP's size hint for M at most ``num_rdma_bytes`` (0: none), at
    most what the low-latency mode takes (MAX_LOW_LATENCY_TOKENS)."""
    low, high = 0, 1
    while get_low_latency_rdma_size_hint(high, hidden, num_ranks, num_experts) <= num_rdma_bytes:
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        fits = get_low_latency_rdma_size_hint(middle, hidden, num_ranks, num_experts)
        low, high = (middle, high) if fits <= num_rdma_bytes else (low, middle)
    return min(low, MAX_LOW_LATENCY_TOKENS)


def _token_ranks(slots: torch.Tensor, experts_per_rank: int, world: int) -> torch.Tensor:
    """[T, W] bool: whether token t has an expert on rank r."""
    ranks = torch.where(slots >= 0, slots.long() // experts_per_rank, world)
    in_rank = torch.zeros(slots.shape[0], world + 1, dtype=torch.bool, device=slots.device)
    in_rank.scatter_(1, ranks, True)
    return in_rank[:, :world]


def _meta_rows(slots, topk_weights, topk: int, rank: int) -> torch.Tensor:
    """[T, 2K + 2] float32: expert id + 1 of each slot (0 for -1), its weight, this rank + 1,
    the token's index + 1; a padding row of zeros decodes to -1 everywhere."""
    num_tokens = slots.shape[0]
    meta = torch.zeros(num_tokens, 2 * topk + 2, dtype=torch.float32, device=slots.device)
    if topk:
        meta[:, :topk] = slots.float() + 1
        if topk_weights is not None:
            meta[:, topk : 2 * topk] = topk_weights
    meta[:, 2 * topk] = rank + 1
    meta[:, 2 * topk + 1] = torch.arange(1, num_tokens + 1, device=slots.device)
    return meta


def _rows(x):
    """x as the Buffer takes it: a tensor, or an FP8 pair with row-major scales."""
    if isinstance(x, (tuple, list)):
        if len(x) != 2:
            raise ValueError(f"x must be a tensor or a (values, scales) pair, got {len(x)} items")
        return x[0], x[1].contiguous()
    return x


def _values(rows) -> torch.Tensor:
    return rows[0] if isinstance(rows, tuple) else rows


def _dtype_of(rows) -> torch.dtype:
    """The Buffer's dtype for these rows: theirs, or bf16 for a pair (combine's dtype)."""
    return torch.bfloat16 if isinstance(rows, tuple) else rows.dtype


def _add_bias(combined: torch.Tensor, bias) -> torch.Tensor:
    terms = bias if isinstance(bias, (tuple, list)) else (bias,)
    total = combined.float()
    for term in terms:
        if term is not None:
            total = total + term.float()
    return total.to(combined.dtype)


def _split_event(outputs, async_finish: bool):
    """A Buffer call's outputs and [its event] (async_finish on GPUs), or []."""
    if async_finish:
        event = outputs[-1]
        return outputs[:-1] if len(outputs) > 2 else outputs[0], [event] if event else []
    return outputs, []


def _event_of(previous_event: EventOverlap | None):
    """The torch.cuda.Event inside a DeepEP previous_event (None: none, or CPU ranks)."""
    if previous_event is None:
        return None
    handle = getattr(previous_event, "event", previous_event)
    return getattr(handle, "event", None)


def _wait(previous_event: EventOverlap | None) -> None:
    if previous_event is not None and previous_event.event is not None:
        previous_event.event.current_stream_wait()


def _wait_if_sync(previous_event, async_finish: bool) -> None:
    """Without async_finish the call runs on the current stream: it waits there first."""
    if not async_finish:
        _wait(previous_event)


def _low_latency_parts(handle):
    if not isinstance(handle, LowLatencyHandle):
        raise ValueError(
            "handle must be the one low_latency_dispatch returned (a 5-tuple rebuilt from its "
            "parts lacks this library's token_slots)"
        )
    return handle.buffer, handle.hybrid_ep


def _refuse_extras(call: str, extras: dict) -> None:
    """The hybrid-ep branch's extra arguments: unsupported unless off."""
    on = {name: value for name, value in extras.items() if value not in (None, False, 0)}
    if on:
        raise ValueError(f"{call}: unsupported argument(s) {sorted(on)} (docs/deep_ep.md)")
