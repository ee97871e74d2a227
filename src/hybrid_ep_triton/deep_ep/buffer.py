"""DeepEP V1's ``Buffer`` (normal and low-latency modes) over ``hybrid_ep_triton.Buffer``.

Each call translates DeepEP's arguments, makes one call of a native Buffer and translates its
outputs: a normal dispatch or combine one call of a Buffer of token rows (``expand=False``,
sized by ``sizing``), a low-latency call one of the low-latency Buffer. The arguments only
DeepEP has are checked here and refused through ``Buffer.refuse``: a ValueError on every rank
in the same call. docs/deep_ep.md lists every difference from DeepEP.
"""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist
import triton

from .. import Buffer as NativeBuffer
from ..buffer import DEFAULT_TIMEOUT_S
from ..ops.reserved import ReservedHeap
from ..runtime.checks import check_mask_out, check_maskable, ranks_per_host
from . import sizing
from .config import Config, get_low_latency_rdma_size_hint, recommended, tokens_that_fit
from .sizing import tensor_problem
from .utils.event import EventHandle, EventOverlap

topk_idx_t = torch.int64
MAX_LOCAL_EXPERTS = 1024  # DeepEP's most local experts of a normal dispatch
# What a low-latency Buffer's heap holds beside the area DeepEP's size hint covers (the mask,
# the normal mode's flags, a token row per rank): tens of KB at the sizes of DeepEP's tests,
# up to a few MB across many nodes, where the hint's margin is larger still.
BESIDE_LOW_LATENCY_BYTES = 8 << 20

__all__ = ["Buffer", "Config", "Handle", "topk_idx_t"]


class Handle(tuple):
    """A dispatch's handle: DeepEP's tuple, carrying the native handle (``native``) and the
    native Buffer of the call (``buffer``); a tuple rebuilt from the parts lacks them, which
    the calls refuse (ValueError).

    A normal dispatch's: DeepEP's intranode 6-tuple (rank_prefix_matrix [W, W] int32, column r
    (this rank) holding the rows received from ranks 0..i, the other columns -1 (DeepEP fills
    them from a count exchange this package does not make); channel_prefix_matrix and
    recv_channel_prefix_matrix None; recv_src_idx [N] int32, each row's source token index, -1
    past the received rows; is_token_in_rank [T, W] bool, the dispatch's; send_head None). A
    low-latency dispatch's: DeepEP's 5-tuple (src_info, layout_range,
    num_max_dispatch_tokens_per_rank, hidden, num_experts).
    """

    def __new__(cls, parts, native, buffer: NativeBuffer):
        handle = super().__new__(cls, parts)
        handle.native, handle.buffer = native, buffer
        return handle


class Buffer:
    """DeepEP V1's communication buffer for expert parallelism (normal and low-latency modes).

    Collective, like DeepEP's: every rank of ``group`` makes one (a host all-gather of host
    names). The native Buffers that move data are made at the first call of each mode, which
    gives the sizes DeepEP's constructor does not: docs/deep_ep.md, "Sizes".

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
        timeout_s: this library's: seconds (float > 0) any wait on another rank may last before
            TimeoutError, or with enable_shrink before that rank is masked.
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
        self.group, self.rank, self.group_size = group, group.rank(), group.size()
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode, self.explicitly_destroy = low_latency_mode, explicitly_destroy
        self.enable_shrink, self.timeout_s = enable_shrink, float(timeout_s)
        self.ranks_per_node = ranks_per_host(sizing.gather(group, socket.gethostname()))
        self._normal = sizing.Sized(group, self._make_normal)
        self._columns: dict = {}  # by device: [W, W] bool, True in this rank's column
        # The low-latency Buffer's heap, reserved as DeepEP allocates its RDMA buffer: the first
        # low-latency call, which makes the Buffer in it, then waits for no rank on the host
        # (one may be gone by then: enable_shrink).
        self._reserved = self._low_latency = None
        if low_latency_mode and num_rdma_bytes > 0:
            device = torch.device("cpu")  # CPU ranks: kernels in Triton's interpreter
            if not triton.knobs.runtime.interpret:
                device = torch.device("cuda", torch.cuda.current_device())
            nbytes = num_rdma_bytes + BESIDE_LOW_LATENCY_BYTES
            self._reserved = ReservedHeap(group, nbytes, device, self.ranks_per_node)
        self._masked = torch.zeros(self.group_size, dtype=torch.int32, device="cpu")
        self._retired: list[NativeBuffer] = []

    # -- DeepEP's static and small calls ----------------------------------------------------

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
        for buffer in [*self._retired, self._low_latency]:
            if buffer is not None:
                buffer.destroy()
        if self._reserved is not None:
            self._reserved.release(self.timeout_s)
        self._retired, self._low_latency, self._reserved = [], None, None

    # -- normal mode -----------------------------------------------------------------------

    def get_dispatch_layout(self, topk_idx, num_experts, previous_event=None, async_finish=False,
                            allocate_on_comm_stream=False):  # fmt: skip
        """What a dispatch sends where; local (no communication), on the current stream.

        Args:
            topk_idx: [T, K] int64 (or int32) global expert ids, -1 for an unused slot.
            num_experts: E, a multiple of the group size.
            previous_event: an EventOverlap the current stream waits for first, or None.
            async_finish: also return an event of the outputs' completion.
            allocate_on_comm_stream: accepted (the outputs are made on the current stream).

        Returns: num_tokens_per_rank [W] int32, num_tokens_per_rdma_rank [nodes] int32 (None
        within one node), num_tokens_per_expert [E] int32, is_token_in_rank [T, W] bool, event.
        """
        if _event_of(previous_event) is not None:
            torch.cuda.current_stream().wait_event(_event_of(previous_event))
        if num_experts % self.group_size:
            raise ValueError(
                f"num_experts must be a multiple of {self.group_size}, got {num_experts}"
            )
        in_rank = sizing.token_ranks(topk_idx, num_experts // self.group_size, self.group_size)
        per_expert = torch.bincount(topk_idx[topk_idx >= 0].long(), minlength=num_experts)
        per_node, nodes = None, self.group_size // self.ranks_per_node
        if nodes > 1:
            per_node = in_rank.view(-1, nodes, self.ranks_per_node).any(2).sum(0, dtype=torch.int32)
        event = EventOverlap(EventHandle() if async_finish else None)
        return in_rank.sum(0, dtype=torch.int32), per_node, per_expert.int(), in_rank, event

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None,
                 topk_weights=None, expert_alignment=1, num_worst_tokens=0, config=None,
                 previous_event=None, async_finish=False,
                 allocate_on_comm_stream=False):  # fmt: skip
        """Send each token to the ranks of its experts, one row per (token, rank). Collective.

        Args:
            x: [T, H] rows (bf16 for DeepEP; fp16, fp32 too), or an FP8 pair (values [T, H]
                float8_e4m3fn, scales [T, H / 128] float32, any strides).
            handle: a dispatch's handle: send ``x`` along its routing (a cached dispatch).
            num_tokens_per_rank: [W] int32, get_dispatch_layout's; not read.
            num_tokens_per_rdma_rank: get_dispatch_layout's; not read.
            is_token_in_rank: [T, W] bool, get_dispatch_layout's: routes the tokens without
                topk_idx; with it, not read (it must be the one computed from it).
            num_tokens_per_expert: [E] int32, get_dispatch_layout's: E; without topk_idx the
                received counts are its sum over the ranks.
            topk_idx: [T, K] int64 (or int32) global expert ids, -1 unused, or None.
            topk_weights: [T, K] float32 with topk_idx, else None.
            expert_alignment: the received counts are rounded up to a multiple of it (>= 1).
            num_worst_tokens: 0, or N (with topk_idx): recv_x has N rows and nothing waits on
                the host (rows past the received ones zero, their recv_topk_idx -1), the counts
                list is empty; rows beyond N are dropped.
            config: a Config (num_sms even): otherwise ignored.
            previous_event: an EventOverlap the call starts after, or None.
            async_finish: run on the native Buffer's stream; the event completes with the call.
            allocate_on_comm_stream: accepted with previous_event and async_finish.

        Returns: recv_x (x's kind, rows by source rank, then source token index), recv_topk_idx
        [N, K] int64 (slot k: the local id of the token's expert k, -1 where that expert is
        elsewhere) or None, recv_topk_weights [N, K] float32 (0 where -1) or None,
        num_recv_tokens_per_expert_list (L ints, aligned), handle, event. A cached dispatch
        returns recv_x, None, None, None, None, event.
        """
        rows, previous = tuple(x) if isinstance(x, list) else x, _event_of(previous_event)
        extras = config, previous_event, async_finish, allocate_on_comm_stream
        if handle is not None:
            _check_handle(handle)
            refused = _extras_refusal(*extras)
            if topk_idx is not None or topk_weights is not None:
                why = "a dispatch with a handle takes no topk_idx or topk_weights"
                refused = "topk_weights", ValueError(why)
            with torch.no_grad():
                if refused is not None:
                    handle.buffer.refuse("dispatch", *refused, handle=handle.native)
                out = handle.buffer.dispatch(rows, handle=handle.native, previous_event=previous,
                                             async_finish=async_finish)  # fmt: skip
            return out[0], None, None, None, None, _overlap(out, async_finish)
        key, slots, num_tokens, worst = sizing.rows_key(rows), topk_idx, 0, num_worst_tokens or None
        refused = self._dispatch_refusal(
            key, rows, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx,
            topk_weights, worst, *extras,
        )  # fmt: skip
        if refused is None:
            key = (*key, num_tokens_per_expert.numel())
            worst_share = -(-num_worst_tokens // self.group_size)  # W x T fits T a rank
            num_tokens = max(sizing.values_of(rows).shape[0], worst_share)
            if topk_idx is None:  # to each rank's first expert, where is_token_in_rank says
                firsts = torch.arange(0, key[3], key[3] // self.group_size, device=key[2])
                slots = torch.where(is_token_in_rank, firsts, -1)

        def call(buffer: NativeBuffer, refused):
            if refused is not None:
                buffer.refuse("dispatch", *refused, max_recv_tokens=worst)
            return buffer.dispatch(rows, slots, topk_weights, pad_multiple=expert_alignment,
                                   max_recv_tokens=worst, previous_event=previous,
                                   async_finish=async_finish)  # fmt: skip

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
            counts = [] if worst else counts.tolist()
        column = self._columns.get(key[2])
        if column is None:  # [W, W] bool, True in this rank's column
            column = torch.arange(self.group_size, device=key[2]) == self.rank
            column = self._columns[key[2]] = column.expand(self.group_size, -1)
        rank_prefix = torch.where(column, native.recv_rank_prefix[:, None], -1)
        parts = rank_prefix, None, None, native.recv_src_idx, is_token_in_rank, None
        handle = Handle(parts, native, self._normal.buffer)
        return recv_x, recv_topk_idx, recv_topk_weights, counts, handle, _overlap(out, async_finish)

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

        Returns: combined_x [T, H] (the sum in fp32, rounded to x's dtype, then each bias added
        in fp32 and rounded again), combined_topk_weights [T, K] float32 or None, event.
        """
        _check_handle(handle)
        buffer, native, previous = handle.buffer, handle.native, _event_of(previous_event)
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
            out = buffer.combine(x, native, topk_weights=topk_weights, previous_event=previous,
                                 async_finish=async_finish)  # fmt: skip
        combined, event = out[0] if isinstance(out, tuple) else out, _overlap(out, async_finish)
        weights = out[1] if topk_weights is not None else None
        if bias is not None:  # added on the current stream, after the sums
            if event.event is not None:
                event.event.current_stream_wait()
            total = combined.float()
            for term in terms:
                total = total if term is None else total + term.float()
            combined = total.to(combined.dtype)
            event = EventOverlap(EventHandle() if async_finish else None)
        return combined, weights, event

    # -- low-latency mode ------------------------------------------------------------------

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank, hidden, num_experts):
        """Nothing to clean (flags carry sequence numbers): checks low_latency_mode, as DeepEP
        does, and once the low-latency Buffer exists is its barrier of the live ranks."""
        self._check_low_latency_mode()
        if self._low_latency is not None:
            tokens = min(num_max_dispatch_tokens_per_rank, self._low_latency.low_latency_tokens)
            self._low_latency.clean_low_latency_buffer(tokens, hidden, num_experts)

    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                             cumulative_local_expert_recv_stats=None,
                             dispatch_wait_recv_cost_stats=None, use_fp8=True, round_scale=False,
                             use_ue8m0=False, async_finish=False, return_recv_hook=False,
                             **hybrid_ep_branch_args):  # fmt: skip
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

        Returns: recv_x (or (values, scales)), recv_count [L] int32, handle, event, hook.
        """
        _refuse_extras("low_latency_dispatch", hybrid_ep_branch_args)
        buffer = self._low_latency_buffer(x, num_max_dispatch_tokens_per_rank, num_experts)
        with torch.no_grad():
            recv_x, count, native, event, hook = buffer.low_latency_dispatch(
                x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                cumulative_local_expert_recv_stats=cumulative_local_expert_recv_stats,
                use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0,
                async_finish=async_finish, return_recv_hook=return_recv_hook,
            )  # fmt: skip
        handle = Handle(tuple(native)[:5], native, buffer)
        return recv_x, count, handle, _overlap((event,), async_finish), hook

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, use_logfmt=False,
                            zero_copy=False, async_finish=False, return_recv_hook=False,
                            out=None, combine_wait_recv_cost_stats=None,
                            **hybrid_ep_branch_args):  # fmt: skip
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

        Returns: combined_x [T, H], event, hook.
        """
        _refuse_extras("low_latency_combine", hybrid_ep_branch_args)
        _check_handle(handle)
        if zero_copy:  # DeepEP reads the buffer the experts wrote into, whatever x is
            x = self.get_next_low_latency_combine_buffer(handle)
        with torch.no_grad():
            combined, event, hook = handle.buffer.low_latency_combine(
                x, topk_idx, topk_weights, handle.native, zero_copy=zero_copy,
                async_finish=async_finish, return_recv_hook=return_recv_hook, out=out,
            )  # fmt: skip
        return combined, _overlap((event,), async_finish), hook

    def get_next_low_latency_combine_buffer(self, handle: Handle) -> torch.Tensor:
        """[L, W * M', H] bf16 in the heap, for the experts' outputs of the next combine."""
        _check_handle(handle)
        return handle.buffer.get_next_low_latency_combine_buffer(handle.native)

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Mask (``mask``) or unmask ``rank_to_mask``, another rank (enable_shrink)."""
        self._check_shrink()
        check_maskable(rank_to_mask, self.rank, self.group_size)
        self._masked[rank_to_mask] = int(bool(mask))
        if self._low_latency is not None:
            self._low_latency.update_mask(rank_to_mask, bool(mask))

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        """Write int32 [W], 1 where a rank is masked, into ``mask_status`` (enable_shrink)."""
        self._check_shrink()
        if self._low_latency is not None:
            return self._low_latency.query_mask(mask_status)
        check_mask_out(mask_status, self.group_size, None)
        mask_status.copy_(self._masked)

    def low_latency_clean_mask_buffer(self) -> None:
        """Unmask every rank (enable_shrink)."""
        self._check_shrink()
        self._masked.zero_()
        if self._low_latency is not None:
            self._low_latency.clean_mask()

    # -- internals -------------------------------------------------------------------------

    def _dispatch_refusal(self, key, rows, per_rank, in_rank, per_expert, topk_idx,
                          topk_weights, worst, *extras) -> sizing.Refusal | None:  # fmt: skip
        """The first of DeepEP's asserts on a dispatch's arguments that the native Buffer does
        not take that fails: (the native argument it stands for, its ValueError), or None."""
        world = self.group_size
        if key is None:
            return "x", ValueError("x must be a [T, H] tensor or an FP8 (values, scales) pair")
        if per_rank is None or in_rank is None or per_expert is None:
            why = "a dispatch needs its layout's num_tokens_per_rank, is_token_in_rank and "
            return "topk_idx", ValueError(why + "num_tokens_per_expert")
        shape = len(sizing.values_of(rows)), world
        problem = (
            tensor_problem("is_token_in_rank", in_rank, torch.bool, key[2], shape)
            or tensor_problem("num_tokens_per_rank", per_rank, torch.int32, key[2], (world,))
            or tensor_problem("num_tokens_per_expert", per_expert, torch.int32, key[2])
        )
        if problem:
            return "topk_idx", ValueError(problem)
        experts = per_expert.numel()
        if per_expert.dim() != 1 or not 0 < experts <= MAX_LOCAL_EXPERTS * world or experts % world:
            why = f"num_tokens_per_expert must be [E], E a multiple of {world} up to "
            return "topk_idx", ValueError(
                f"{why}{MAX_LOCAL_EXPERTS * world}, got {tuple(per_expert.shape)}"
            )
        if (topk_idx is None) != (topk_weights is None):
            return "topk_weights", ValueError("pass topk_idx with topk_weights (DeepEP asserts)")
        if worst and topk_idx is None:
            return "max_recv_tokens", ValueError("num_worst_tokens needs topk_idx")
        return _extras_refusal(*extras)

    def _summed_counts(self, num_tokens_per_expert: torch.Tensor, alignment: int) -> list:
        """This rank's received count per local expert without topk_idx: the sum of every
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
            self.group, hidden_size=hidden, max_tokens_per_rank=capacity, num_experts=experts,
            dtype=dtype, expand=False, device=device, ranks_per_node=self.ranks_per_node,
            timeout_s=self.timeout_s,
        )  # fmt: skip

    def _check_low_latency_mode(self) -> None:
        if not self.low_latency_mode:
            raise ValueError("the low-latency calls need a Buffer made with low_latency_mode=True")

    def _check_shrink(self) -> None:
        if not self.enable_shrink:
            raise ValueError("rank masking needs Buffer(..., enable_shrink=True), as DeepEP's")

    def _low_latency_buffer(self, x, tokens: int, num_experts: int) -> NativeBuffer:
        """The low-latency Buffer, made (or made again, larger) when a call needs it. Every rank
        passes the same M', hidden size and E (DeepEP's rule), so each decides alike."""
        self._check_low_latency_mode()
        buffer, hidden = self._low_latency, x.shape[-1]
        if (
            buffer is not None
            and buffer.low_latency_tokens >= tokens
            and (
                (buffer.hidden_size, buffer.num_experts, buffer.dtype)
                == (hidden, num_experts, x.dtype)
            )
        ):
            return buffer
        if buffer is not None:
            self._retired.append(buffer)
        fit = tokens_that_fit(self.num_rdma_bytes, hidden, self.group_size, num_experts)
        buffer = self._low_latency = NativeBuffer(
            self.group, hidden_size=hidden, max_tokens_per_rank=0, num_experts=num_experts,
            dtype=x.dtype, ranks_per_node=self.ranks_per_node, device=x.device,
            low_latency_tokens=max(tokens, fit), mask_failed_ranks=self.enable_shrink,
            timeout_s=self.timeout_s, heap=self._reserved,
        )  # fmt: skip
        for rank in self._masked.nonzero().flatten().tolist():
            buffer.update_mask(rank, True)
        return buffer


def _check_handle(handle) -> None:
    """A Handle of this package's calls: else a ValueError on this rank, as the native
    Buffer's for a handle that is none of its own."""
    if type(handle) is not Handle:
        raise ValueError(
            "handle must be one that this Buffer's calls returned (a tuple rebuilt from its "
            f"parts lacks the native handle and its token_slots), got {type(handle).__name__}"
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


def _event_of(previous_event: EventOverlap | None):
    """The torch.cuda.Event inside a DeepEP previous_event (None: none, or CPU ranks)."""
    return getattr(getattr(previous_event, "event", None), "event", None)


def _overlap(outputs: tuple, async_finish: bool) -> EventOverlap:
    """DeepEP's event of a native call's ``outputs`` (with async_finish the last, an event or
    None on CPU ranks, whose calls complete before they return)."""
    return EventOverlap(EventHandle.of(outputs[-1]) if async_finish else None)


def _refuse_extras(call: str, extras: dict) -> None:
    """The hybrid-ep branch's extra arguments: unsupported unless off."""
    on = sorted(name for name, value in extras.items() if value not in (None, False, 0))
    if on:
        raise ValueError(f"{call}: unsupported argument(s) {on} (docs/deep_ep.md)")
