"""DeepEP V1's ``Buffer`` (normal and low-latency modes) over ``hybrid_ep_triton.Buffer``.

Each call translates DeepEP's arguments, makes one native call (a normal dispatch or combine
on a Buffer of token rows sized by ``sizing``, a low-latency call on the low-latency Buffer)
and translates its outputs. DeepEP's own arguments are checked here and refused through
``Buffer.refuse``, as the native Buffer refuses its own. docs/deep_ep.md: every difference.
"""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist

from .. import Buffer as NativeBuffer
from ..buffer import DEFAULT_TIMEOUT_S
from ..runtime.checks import ranks_per_host
from . import sizing
from .config import Config, get_low_latency_rdma_size_hint, recommended
from .low_latency import LowLatencyMode
from .sizing import Handle, check_handle, tensor_problem
from .utils.event import EventHandle, EventOverlap, native_event, overlap

topk_idx_t = torch.int64
MAX_LOCAL_EXPERTS = 1024  # DeepEP's most local experts of a normal dispatch

__all__ = ["Buffer", "Config", "topk_idx_t"]


class Buffer(LowLatencyMode):
    """DeepEP V1's communication buffer for expert parallelism (normal and low-latency modes).

    Collective: every rank of ``group`` makes one (a host all-gather of host names). The native
    Buffers are made at each mode's first call, which has the sizes DeepEP's constructor lacks
    (docs/deep_ep.md, "Sizes").

    Args:
        group: the torch.distributed group of the expert-parallel ranks (NCCL, or gloo).
        num_nvl_bytes: DeepEP's NVLink buffer bytes: recorded; no Buffer is sized from it.
        num_rdma_bytes: bytes whose DeepEP size hint sizes the low-latency area's tokens.
        low_latency_mode: allow the low-latency calls (DeepEP asserts it there; so here).
        num_qps_per_rank: DeepEP's RDMA queue pairs: ignored (NVSHMEM's own transport).
        allow_nvlink_for_low_latency_mode: ignored (peers of a node always use NVLink).
        allow_mnnvl: ignored (nodes are hosts).
        explicitly_destroy: whether ``destroy()`` frees the buffers (required to call it).
        enable_shrink: DeepEP's rank masking (the low_latency_*_mask_buffer calls; a peer that
            does not answer a low-latency call within timeout_s is masked).
        comm: an mpi4py communicator: unsupported (ValueError).
        timeout_s: this library's: seconds (> 0) a wait on another rank may last.
    """

    num_sms: int = 20

    def __init__(self, group, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False,
                 num_qps_per_rank=24, allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False,
                 explicitly_destroy=False, enable_shrink=False, comm=None,
                 timeout_s=DEFAULT_TIMEOUT_S):  # fmt: skip
        if group is None:
            if comm is not None:
                raise ValueError("an mpi4py comm is not supported: pass a torch.distributed group")
            raise ValueError("Either 'group' or 'comm' must be provided.")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.group, self.rank = group, dist.get_rank(group)
        self.group_size = dist.get_world_size(group)
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode, self.explicitly_destroy = low_latency_mode, explicitly_destroy
        self.enable_shrink, self.timeout_s = enable_shrink, float(timeout_s)
        self.ranks_per_node = ranks_per_host(sizing.gather(group, socket.gethostname()))
        self._normal = sizing.Sized(group, self._make_normal)
        self._columns: dict = {}  # by device: [W, W] bool, True in this rank's column
        self._reserve_low_latency()

    @staticmethod
    def is_sm90_compiled() -> bool:
        """True: FP8 rows and every format this library moves need no separate build."""
        return True

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Record DeepEP's SM count for the recommended configs (even, as DeepEP asserts)."""
        if new_num_sms % 2:
            raise ValueError(f"The SM count must be even, got {new_num_sms}")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        """An event on the current CUDA stream (none on CPU ranks), for previous_event."""
        return EventOverlap(EventHandle())

    get_low_latency_rdma_size_hint = staticmethod(get_low_latency_rdma_size_hint)

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """DeepEP's recommended dispatch Config for ``num_ranks`` (ValueError for others)."""
        return recommended(Buffer.num_sms, num_ranks, combine=False)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """DeepEP's recommended combine Config for ``num_ranks`` (ValueError for others)."""
        return recommended(Buffer.num_sms, num_ranks, combine=True)

    def get_comm_stream(self):
        """Unsupported: each native Buffer runs async calls on a stream it does not expose."""
        raise ValueError("get_comm_stream is not supported (each native Buffer's own stream)")

    def get_local_buffer_tensor(self, *args, **kwargs):
        """Unsupported: there is no raw DeepEP buffer to view."""
        raise ValueError("get_local_buffer_tensor is not supported (no raw DeepEP buffer)")

    def destroy(self) -> None:
        """Free every buffer (collective). DeepEP requires explicitly_destroy=True; so here."""
        if not self.explicitly_destroy:
            raise ValueError("`explicitly_destroy` flag must be set")
        self._normal.destroy()
        self._destroy_low_latency()

    # -- normal mode -----------------------------------------------------------------------

    def get_dispatch_layout(self, topk_idx, num_experts, previous_event=None, async_finish=False,
                            allocate_on_comm_stream=False):  # fmt: skip
        """What a dispatch sends where, with torch ops on the current stream (no communication).

        Args:
            topk_idx: [T, K] int64 (or int32) global expert ids, -1 for an unused slot.
            num_experts: E, a multiple of the group size.
            previous_event: an EventOverlap the current stream waits for first, or None.
            async_finish: also return an event of the outputs' completion.
            allocate_on_comm_stream: accepted.

        Returns: num_tokens_per_rank [W] int32, num_tokens_per_rdma_rank [nodes] int32 (None
        within a node), num_tokens_per_expert [E] int32, is_token_in_rank [T, W] bool, event.
        """
        if native_event(previous_event) is not None:
            torch.cuda.current_stream().wait_event(native_event(previous_event))
        counts = NativeBuffer.token_counts(
            topk_idx, num_experts, self.group_size, self.ranks_per_node
        )
        return *counts, EventOverlap(EventHandle() if async_finish else None)

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None,
                 topk_weights=None, expert_alignment=1, num_worst_tokens=0, config=None,
                 previous_event=None, async_finish=False,
                 allocate_on_comm_stream=False):  # fmt: skip
        """Send each token to the ranks of its experts, one row per (token, rank). Collective.

        Args:
            x: [T, H] rows (bf16; fp16, fp32 too) or an FP8 pair ([T, H] e4m3, [T, H / 128] fp32).
            handle: a dispatch's handle: send ``x`` along its routing (a cached dispatch).
            num_tokens_per_rank: [W] int32, get_dispatch_layout's; not read.
            num_tokens_per_rdma_rank: get_dispatch_layout's; not read.
            is_token_in_rank: [T, W] bool, get_dispatch_layout's: the routing without topk_idx.
            num_tokens_per_expert: [E] int32, get_dispatch_layout's: E (without topk_idx, counts).
            topk_idx: [T, K] int64 (or int32) global expert ids, -1 unused, or None.
            topk_weights: [T, K] float32 with topk_idx, else None.
            expert_alignment: round the received counts up to a multiple of it (>= 1).
            num_worst_tokens: 0, or N: N rows, no host synchronisation, no counts (topk_idx only).
            config: a Config (num_sms even): otherwise ignored.
            previous_event: an EventOverlap the call starts after, or None.
            async_finish: run on the native Buffer's stream; the event completes with the call.
            allocate_on_comm_stream: accepted with previous_event and async_finish.

        Returns: recv_x (x's kind; rows by source rank, then source token), recv_topk_idx [N, K]
        int64 (slot k: the local id of the token's expert k, -1 where it is elsewhere) or None,
        recv_topk_weights [N, K] float32 (0 where -1) or None, num_recv_tokens_per_expert_list
        (L ints, aligned; [] with num_worst_tokens), handle (DeepEP's 6-tuple: rank_prefix_matrix
        [W, W] int32 of this rank's column, others -1; None, None; recv_src_idx [N] int32;
        is_token_in_rank; None), event. A cached dispatch: recv_x, None x 4, event.
        """
        rows, previous = x, native_event(previous_event)
        if isinstance(x, (tuple, list)):  # DeepEP takes scales of any strides: made row-major
            rows = (x[0], x[1].contiguous()) if len(x) == 2 and hasattr(x[1], "contiguous") else x
        extras = config, previous_event, async_finish, allocate_on_comm_stream
        if handle is not None:
            check_handle(handle)
            refused = _extras_refusal(*extras)
            if topk_idx is not None or topk_weights is not None:
                why = "a dispatch with a handle takes no topk_idx or topk_weights (DeepEP asserts)"
                refused = "topk_weights", ValueError(why)
            with torch.no_grad():
                if refused is not None:
                    handle.buffer.refuse("dispatch", *refused, handle=handle.native)
                out = handle.buffer.dispatch(
                    rows, handle=handle.native, previous_event=previous, async_finish=async_finish
                )
            return out[0], None, None, None, None, overlap(out, async_finish)
        key, slots, num_tokens, worst = sizing.rows_key(rows), topk_idx, 0, num_worst_tokens or None
        refused = self._dispatch_refusal(
            key,
            rows,
            num_tokens_per_rank,
            is_token_in_rank,
            num_tokens_per_expert,
            topk_idx,
            topk_weights,
            worst,
            *extras,
        )
        if refused is None:
            key = (*key, num_tokens_per_expert.numel())
            worst_share = -(-num_worst_tokens // self.group_size)  # W x T holds T a rank
            num_tokens = max(sizing.values_of(rows).shape[0], worst_share)
            if topk_idx is None:  # to each rank's first expert, where is_token_in_rank says
                firsts = torch.arange(0, key[3], key[3] // self.group_size, device=key[2])
                slots = torch.where(is_token_in_rank, firsts, -1)

        def call(buffer: NativeBuffer, refused):
            if refused is not None:
                buffer.refuse("dispatch", *refused, max_recv_tokens=worst)
            return buffer.dispatch(
                rows,
                slots,
                topk_weights,
                pad_multiple=expert_alignment,
                max_recv_tokens=worst,
                previous_event=previous,
                async_finish=async_finish,
            )

        before = self._normal.key  # a new E stands for topk_idx, new rows for x
        changed = "topk_idx" if refused is None and before and key[3] != before[3] else "x"
        with torch.no_grad():
            out = self._normal.run(key, num_tokens, call, refused, worst is None, changed)
        recv_x, recv_topk_idx, recv_topk_weights, counts, native = out[:5]
        if topk_idx is None:
            recv_topk_idx = None
            counts = self._summed_counts(num_tokens_per_expert, expert_alignment)
        else:
            if recv_topk_idx.dtype != torch.int64:  # (of int32 topk_idx)
                recv_topk_idx = recv_topk_idx.long()
            counts = [] if worst else native.tokens_per_expert_list
        column = self._columns.get(key[2])
        if column is None:
            column = torch.arange(self.group_size, device=key[2]) == self.rank
            column = self._columns[key[2]] = column.expand(self.group_size, -1)
        rank_prefix = torch.where(column, native.recv_rank_prefix[:, None], -1)
        parts = rank_prefix, None, None, native.recv_src_idx, is_token_in_rank, None
        handle = Handle(parts, native, self._normal.buffer)
        return recv_x, recv_topk_idx, recv_topk_weights, counts, handle, overlap(out, async_finish)

    def combine(self, x, handle, topk_weights=None, bias=None, config=None, previous_event=None,
                async_finish=False, allocate_on_comm_stream=False):  # fmt: skip
        """Sum each token's rows from every rank it went to (no weights). Collective.

        Args:
            x: [N, H] rows in recv_x's order, of the dispatch's rows' dtype.
            handle: the dispatch's handle.
            topk_weights: [N, K] float32 (K: the dispatch's), or None: also summed per token.
            bias: None, a [T, H] tensor of x's dtype, or a pair of them, added to the sums.
            config: a Config (num_sms even): otherwise ignored.
            previous_event, async_finish, allocate_on_comm_stream: as for ``dispatch``.

        Returns: combined_x [T, H] (fp32 sums rounded to x's dtype; each bias then added in fp32
        and rounded again), combined_topk_weights [T, K] float32 or None, event.
        """
        check_handle(handle)
        buffer, native, previous = handle.buffer, handle.native, native_event(previous_event)
        refused = _extras_refusal(config, previous_event, async_finish, allocate_on_comm_stream)
        terms = bias if isinstance(bias, (tuple, list)) else (bias,)
        if len(terms) > 2:
            refused = "y", ValueError(f"bias must be a tensor or a pair, got {len(terms)} items")
        for term in terms if refused is None else ():
            shape = native.num_tokens, buffer.hidden_size
            problem = term is not None and tensor_problem(
                "bias", term, buffer.dtype, buffer.device, shape
            )
            refused = ("y", ValueError(problem)) if problem else refused
        with torch.no_grad():
            if refused is not None:
                buffer.refuse("combine", *refused, handle=native)
            out = buffer.combine(
                x,
                native,
                topk_weights=topk_weights,
                previous_event=previous,
                async_finish=async_finish,
            )
        combined, event = out[0] if isinstance(out, tuple) else out, overlap(out, async_finish)
        if bias is not None:  # added on the current stream, after the sums
            if event.event is not None:
                event.event.current_stream_wait()
            total = combined.float()
            for term in terms:
                total = total if term is None else total + term.float()
            combined = total.to(combined.dtype)
            event = EventOverlap(EventHandle() if async_finish else None)
        return combined, out[1] if topk_weights is not None else None, event

    # -- internals -------------------------------------------------------------------------

    def _dispatch_refusal(
        self, key, rows, per_rank, in_rank, per_expert, topk_idx, topk_weights, worst, *extras
    ) -> sizing.Refusal | None:
        """The first of DeepEP's asserts on a dispatch's own arguments that fails: (the native
        argument it stands for, its ValueError), or None."""
        world = self.group_size
        if key is None:
            return "x", ValueError("x must be a [T, H] tensor or an FP8 (values, scales) pair")
        if per_rank is None or in_rank is None or per_expert is None:
            why = "a dispatch needs num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert"
            return "topk_idx", ValueError(why)
        problem = (
            tensor_problem(
                "is_token_in_rank",
                in_rank,
                torch.bool,
                key[2],
                (sizing.values_of(rows).shape[0], world),
            )
            or tensor_problem("num_tokens_per_rank", per_rank, torch.int32, key[2], (world,))
            or tensor_problem("num_tokens_per_expert", per_expert, torch.int32, key[2])
        )
        experts, most = per_expert.numel() if not problem else 0, MAX_LOCAL_EXPERTS * world
        if not problem and (per_expert.dim() != 1 or not 0 < experts <= most or experts % world):
            problem = f"num_tokens_per_expert must be [E], E a multiple of {world} up to {most}"
        if problem:
            return "topk_idx", ValueError(problem)
        if (topk_idx is None) != (topk_weights is None):
            return "topk_weights", ValueError("pass topk_idx with topk_weights (DeepEP asserts)")
        if worst and topk_idx is None:
            return "max_recv_tokens", ValueError("num_worst_tokens needs topk_idx")
        return _extras_refusal(*extras)

    def _summed_counts(self, num_tokens_per_expert: torch.Tensor, alignment: int) -> list:
        """Without topk_idx: this rank's received count per local expert, the sum of every
        rank's num_tokens_per_expert (an all-reduce), rounded up to ``alignment``."""
        counts = num_tokens_per_expert.to(torch.int64)
        counts = counts if dist.get_backend(self.group) == "nccl" else counts.cpu()
        dist.all_reduce(counts, group=self.group)
        local = counts.numel() // self.group_size
        mine = counts[self.rank * local : (self.rank + 1) * local].tolist()
        return [-(-count // alignment) * alignment for count in mine]

    def _make_normal(self, key, capacity: int) -> NativeBuffer:
        """The normal mode's Buffer of token rows for ``key`` (hidden, dtype, device, E)."""
        hidden, dtype, device, experts = key
        return NativeBuffer(
            self.group,
            hidden_size=hidden,
            max_tokens_per_rank=capacity,
            num_experts=experts,
            dtype=dtype,
            expand=False,
            device=device,
            ranks_per_node=self.ranks_per_node,
            timeout_s=self.timeout_s,
        )


def _extras_refusal(config, previous_event, async_finish, allocate_on_comm_stream):
    """DeepEP's asserts on a normal call's config and allocate_on_comm_stream: (the native
    argument they stand for, the ValueError), or None."""
    if config is not None and config.num_sms % 2:
        return "previous_event", ValueError(f"config.num_sms must be even, got {config.num_sms}")
    if allocate_on_comm_stream and not (getattr(previous_event, "event", None) and async_finish):
        why = "allocate_on_comm_stream needs previous_event and async_finish (DeepEP asserts)"
        return "previous_event", ValueError(why)
    return None
