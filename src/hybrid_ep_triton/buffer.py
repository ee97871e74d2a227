"""``Buffer``: the library's one public class, expert-parallel dispatch and combine."""

import socket

import torch
import torch.distributed as dist

from .ops import library, low_latency, make_runtime, status
from .ops.dispatch import DispatchHandle
from .ops.scaled_rows import ScaledValues
from .runtime.checks import (
    check_contiguous_rows,
    check_flag,
    check_int,
    check_interpreted_on_cpu,
    check_low_latency_combine,
    check_low_latency_dispatch,
    check_quantize_format,
    check_tensor,
    describe,
)
from .runtime.planner import (
    MAX_SMS,
    MAX_TOPK,
    SCALED_FORMATS,
    ScaledFormat,
    low_latency_bytes,
    make_plan,
)
from .runtime.tuning import cache_key, select_config

DEFAULT_TIMEOUT_S = 60.0
# Unchecked max_recv_tokens dispatches remembered for the next exact-mode call.
_MAX_UNCHECKED = 1024
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class Buffer:
    """Expert-parallel dispatch and combine over one group of ranks.

    Rank r of the group owns global experts [r*L, (r+1)*L) with L = num_experts / group size.
    The constructor is collective: it checks that every rank passed the same parameters and
    allocates the worst-case buffers: a symmetric staging area of max_tokens_per_rank rows from
    every rank, and a local outbox of the same size for combine's partial rows (across nodes
    also a network inbox and outbox of max_tokens_per_rank rows per node). Dispatch and
    combine are collective too, called in the same order on every rank.

    Across nodes (the group spans several nodes of ranks_per_node ranks each) a token crosses
    the network at most once per destination node, to the rank with its own local index there,
    which forwards it over NVLink to the ranks of its node that hold its experts; combine sums
    a token's rows inside each node, and the node's partial sum crosses the network once.
    Network transfers are NVSHMEM puts issued by the kernels. Outputs, orderings and errors are
    the same as within one node.

    Args:
        group: torch.distributed group of the expert-parallel ranks (None: the default group),
            through which the Buffer makes its host-side collectives (parameter check, host
            names, heap set-up, NVSHMEM's unique id), all with CPU objects where the group is
            gloo: NCCL with one GPU per rank; gloo for CPU ranks (TRITON_INTERPRET=1) and for
            ranks that share GPUs (NCCL rejects two ranks of a group on one GPU; run them under
            CUDA MPS, see the README's "Testing on one GPU").
        hidden_size: H, elements per token row.
        max_tokens_per_rank: most tokens any rank passes to one dispatch.
        num_experts: E, global experts, divisible by the group size.
        dtype: element type of token rows: torch.bfloat16, torch.float16 or torch.float32.
        num_sms: SMs' worth of warps (16 warps each) for the programs (channels) that move
            data between ranks in dispatch and combine; 1..132. With 8-warp programs (the
            default) that is 2 * num_sms channels, which the GPU may place on up to twice as many
            SMs, each beside a program of the local work. The work that stays on the GPU
            (dispatch's expansion into expert-major rows, combine's reduction of a token's
            expert rows and its final sum) runs in the same launches on the rest of the GPU,
            overlapped with the transfer.
            Default: the tuned configuration's (``hybrid-ep tune``), else 8 on GPUs and 2 on
            CPU ranks; on a GPU at most the SMs this process's CUDA context may use (an MPS
            share may give it fewer). A num_sms given above those is a ValueError. The other
            kernel parameters come from the tuning cache when it has an entry for this GPU,
            Triton version, group size, hidden size, dtype and ``expand``, else from the
            planner's heuristic.
        timeout_s: seconds any wait on another rank may last before TimeoutError (default 60).
        ranks_per_node: R, consecutive ranks that reach each other over NVLink (a node); it must
            divide the group size. None (default): the ranks that share a host (they must be
            consecutive). A group of one node (R == group size) moves everything over NVLink.
        device: where tokens live: None (default) the current CUDA device with an NCCL group,
            the CPU with gloo; a CUDA device (it must be this process's current one) also with
            a gloo group; the CPU only with gloo. The same kind on every rank.
        expand: True (default): dispatch expands every received token into one row per local
            expert it selected, grouped by expert, ready for a grouped GEMM. False: one row per
            received token, as DeepEP's dispatch returns it, with the token's local expert ids
            and weights beside it; the grouping (permute) is left to the caller. That writes a
            quarter of the bytes at top-8 of 256 experts over 2 ranks (about 4 experts per
            token on each rank), and combine then sums one row per (token, rank).
        agree_on_inputs: False (default): calls stay asynchronous, with no host collective;
            an input that one rank's host refuses in a dispatch along a handle or a combine is
            a ValueError there at once and on its peers at their next dispatch with a new
            layout (README, Errors). True, for debugging (as TORCH_DISTRIBUTED_DEBUG=DETAIL
            checks collectives): every dispatch and combine first gathers over ``group``, on the
            host, whether each rank's host passed its inputs (the handle too), so that a refused
            one is a ValueError on every rank of that very call, naming the rank, the argument
            and why, and nothing moves; a host collective per call (with an NCCL group it
            synchronises the device), so not for CUDA graph capture. The same on every rank.
        low_latency_tokens: M, most tokens a rank passes to one low-latency call (decode,
            ``low_latency_dispatch``); 0 (default): no low-latency mode. Its heap area,
            ``low_latency_bytes(M, H, W, E)`` bytes a rank, is allocated here. The same on every
            rank.

    Attributes: the arguments above (``device`` resolved: a torch.device with its index).
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        *,
        hidden_size: int,
        max_tokens_per_rank: int,
        num_experts: int,
        dtype: torch.dtype = torch.bfloat16,
        num_sms: int | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        expand: bool = True,
        ranks_per_node: int | None = None,
        device: torch.device | str | None = None,
        agree_on_inputs: bool = False,
        low_latency_tokens: int = 0,
    ):
        group = group if group is not None else dist.group.WORLD
        world = dist.get_world_size(group)
        try:
            device = _token_device(device, group)
            _check_parameters(world, hidden_size, max_tokens_per_rank, num_experts, dtype,
                              num_sms, timeout_s, expand, ranks_per_node, device,
                              agree_on_inputs)  # fmt: skip
            check_int("low_latency_tokens", low_latency_tokens, 0)
            refused = None
        except ValueError as error:
            refused = error
        # Every rank gathers the host names (so that ranks passing and not passing
        # ranks_per_node still make the same collectives) and whether it refused its
        # parameters: a refusal on any rank is a ValueError on every rank.
        hosts = _gather_or_refuse(group, socket.gethostname(), refused)
        if ranks_per_node is None:
            ranks_per_node = ranks_per_host(hosts)
        on_gpu = device.type == "cuda"
        key = cache_key(device, world, hidden_size, dtype, expand, ranks_per_node)
        # The SMs this process's context may use: under an MPS share (ranks sharing a GPU) the
        # context reports and gets that share alone (bench/results/*-mps-probe.log).
        context_sms = (
            torch.cuda.get_device_properties(device).multi_processor_count if on_gpu else None
        )
        config = select_config(
            key, hidden_size, max_tokens_per_rank, num_sms, on_gpu, available_sms=context_sms
        )
        if on_gpu and config.num_sms > context_sms:
            refused = ValueError(
                f"num_sms={config.num_sms} is more than the {context_sms} SMs this process's "
                f"CUDA context may use (an MPS share, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, gives "
                "a context part of the GPU)"
            )
        _check_same_on_all_ranks(
            group,
            refused,
            hidden_size=hidden_size,
            max_tokens_per_rank=max_tokens_per_rank,
            num_experts=num_experts,
            dtype=dtype,
            num_sms=config.num_sms,
            expand=expand,
            ranks_per_node=ranks_per_node,
            device_type=device.type,
            agree_on_inputs=agree_on_inputs,
            low_latency_tokens=low_latency_tokens,
            kernel_config=config,  # from each rank's tuning cache: must agree too
        )
        plan = make_plan(
            world, hidden_size, max_tokens_per_rank, num_experts, dtype, config,
            token_rows=not expand, ranks_per_node=ranks_per_node,
            low_latency_tokens=low_latency_tokens,
        )  # fmt: skip
        self.group = group
        self.hidden_size = hidden_size
        self.max_tokens_per_rank = max_tokens_per_rank
        self.num_experts = num_experts
        self.dtype = dtype
        self.expand = expand
        self.ranks_per_node = ranks_per_node
        self.device = device
        self.timeout_s = float(timeout_s)
        self.agree_on_inputs = agree_on_inputs
        self.low_latency_tokens = low_latency_tokens
        # The send area of the next low-latency call (they alternate, as DeepEP's buffers), and
        # the last two calls' cells [whether its receive hook is yet to be called], oldest
        # first: a bit and two flags rather than a count, which torch.compile would guard on.
        self._next_area = 0
        self._last_calls: list[list[bool]] = []
        # max_recv_tokens dispatches whose overflow nobody has checked yet: (the handle's state,
        # whose [0] is the rows it needed, M).
        self._unchecked: list[tuple[torch.Tensor, int]] = []
        # A refused call along a handle that the next new-layout dispatch must tell the peers
        # of: the argument (ops/dispatch.ALONG_A_HANDLE), or None.
        self._refused_along: str | None = None
        self._rt = make_runtime(plan, group, device, timeout_s, context_sms)
        self._id = library.register(self._rt)
        self._comm_stream: torch.cuda.Stream | None = None

    # -- public API -------------------------------------------------------------------------

    def dispatch(
        self,
        x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        topk_idx: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        *,
        pad_multiple: int = 1,
        max_recv_tokens: int | None = None,
        handle: DispatchHandle | None = None,
        quantize: bool | str = False,
        expert_recv_stats: torch.Tensor | None = None,
        previous_event: torch.cuda.Event | None = None,
        async_finish: bool = False,
    ):
        """Send every token to the ranks that hold its experts, grouped by local expert there
        (with ``expand=False``: one row per token there).

        Args:
            x: [T, H] tokens of this rank, the Buffer's dtype; 0 <= T <= max_tokens_per_rank.
                Or block-scaled rows, a pair (values, scales) whose dtypes name the format
                (channel h of token t is value(t, h) * scales[t, h // block]; scales row-major,
                one row per token):
                - fp8 (DeepSeek-V3): values [T, H] float8_e4m3fn, scales [T, H / 128] float32;
                - mxfp8 (OCP MX v1.0): values [T, H] float8_e4m3fn, scales [T, H / 32]
                  float8_e8m0fnu (powers of two);
                - nvfp4: values [T, H / 2] float4_e2m1fn_x2 (channel 2i in byte i's low
                  nibble), scales [T, H / 16] float8_e4m3fn (an NVFP4 per-tensor scale is not
                  a row's: it stays with the caller, and must be the same on every rank);
                H a multiple of the format's block, any Buffer dtype; values need a row stride
                and start that are multiples of 4 bytes. recv_x is then such a pair too, each
                row's scales moved with it (padding rows: values 0, scales 0), its scales
                row-major (swizzle them for a GEMM that reads cuBLAS' 128x4 blocked layout,
                ``reference.to_blocked``); where a row's scales do not fill whole 4-byte words
                (mxfp8 at H = 2880) recv_scales is a view of wider rows. A pair given as x
                carries no gradient: ValueError if its values or scales require grad.
            topk_idx: [T, K] int32 or int64 global expert ids, -1 for an unused slot, distinct
                within a row. Not needed with ``handle``.
            topk_weights: [T, K] float32 routing weights, or None.
            pad_multiple: pad each expert's segment with zero rows (weight 0) to a multiple of it
                (1 with ``expand=False``).
            max_recv_tokens: None: the output has exactly the rows needed (the host waits for the
                layout kernel's row count, written into pinned host memory; the data move is
                already launched and waits for the outputs' addresses). M: the output has M
                rows, with no host synchronisation; rows past the valid count are zero; rows
                that do not fit are dropped, and ``check`` (or the
                next exact-mode dispatch of this Buffer, once its work is done) raises
                OverflowError. Size M as world * max_tokens_per_rank * min(K, L) plus
                L * (pad_multiple - 1) (with ``expand=False``: world * max_tokens_per_rank) to
                never drop a row.
            handle: the handle of an earlier dispatch: send new rows ``x`` along the same routing
                without recomputing the layout (topk_idx, pad_multiple and max_recv_tokens are
                taken from it). Pairs of any format and rows of the Buffer's dtype may share a
                handle. An input refused along a handle is a ValueError here while the call
                still runs with zero rows (no peer waits); this rank's next dispatch with a new
                layout is then a ValueError on every rank, which moves nothing (README, Errors).
            quantize: "fp8" (or True), "mxfp8" or "nvfp4": x in the Buffer's dtype is
                quantized by the dispatch launch as it sends it (``reference.quantize_fp8``,
                ``quantize_mxfp8`` and ``quantize_nvfp4``, without a per-tensor scale, state
                the rules; the kernels match them bit for bit), so that only the format's
                values and scales cross the links; recv_x is the format's pair; H % 128 == 0.
                When x requires grad (and grad mode is on), the pair's values are a
                ``ScaledValues`` (ops/scaled_rows.py) instead of a plain tensor: to torch [N, H]
                of the Buffer's dtype, holding the quantized values in ``.quantized`` (what a
                block-scaled GEMM reads, with the pair's scales, also in ``.scales``); every
                other torch op on it (dispatch and combine included) sees the dequantized rows
                (value * scale in float32, rounded to the Buffer's dtype) and returns plain
                tensors. Its gradient, [N, H] of the Buffer's dtype, goes straight through the
                quantization: grad x[t] is the sum of the gradients of the rows token t landed
                on (padding rows add nothing), as for a dispatch of x itself; topk_weights'
                gradient is as without quantize; the scales carry none. Also along a handle, in
                both layouts; eager mode only (torch.compile is not covered with x requiring
                grad).
            expert_recv_stats: int64 [L] on the Buffer's device, or None: a dispatch that
                computes a layout (no ``handle``) adds into it, on the device and in the call's
                stream order (no host synchronisation, CUDA-graph capturable), the tokens routed
                to each local expert by every rank: (token, expert) pairs, padding not counted,
                rows dropped past max_recv_tokens counted. Load balancers read it (DeepEP's
                cumulative_local_expert_recv_stats).
            previous_event: a CUDA event the call waits for before it starts (instead of the
                calling stream's work so far, with async_finish).
            async_finish: run on the Buffer's communication stream and also return an event
                that completes with the call, so the calling stream can compute meanwhile (see
                ``README``: calls of one Buffer must stay ordered). On CPU ranks the call is
                synchronous and the event is None.

        Returns, with ``expand=True``:
            recv_x: [N, H], rows grouped by local expert 0..L-1, within an expert by source
                rank, then by source token index.
            recv_weights: [N] float32, the weight of each row's (token, expert) pair (0 on
                padding), or None when topk_weights is None.
            tokens_per_expert: [L] int64, rows of each local expert, padding included.
            handle: for ``combine`` and cached dispatches.
            event: only with async_finish, see above.
        With ``expand=False``: recv_x, recv_topk_idx, recv_topk_weights, tokens_per_expert,
        handle (and event), where
            recv_x: [N, H], one row per token that has an expert here, by source rank, then by
                source token index.
            recv_topk_idx: [N, K] int32, the local expert ids (0..L-1) of the row's token here,
                in the token's slot order, then -1.
            recv_topk_weights: [N, K] float32, their weights (0 after them), or None when
                topk_weights is None.
            tokens_per_expert: [L] int64, (token, expert) pairs of each local expert (of all
                tokens sent here, also rows dropped past max_recv_tokens).
        A cached dispatch returns its handle's recv_topk_idx.
        """
        new_layout = handle is None
        call = "dispatch" if new_layout else "cached dispatch"
        self._check_usable_for(call)
        rt = self._rt
        if not new_layout and not self.agree_on_inputs:
            self._check_handle(handle)  # (without one of this Buffer's, no part in the call)
        try:
            if not new_layout and self.agree_on_inputs:
                with _refusing("handle"):
                    self._check_handle(handle)
            x, x_scales, scaled = self._checked_dispatch_inputs(
                x, topk_idx, topk_weights, pad_multiple, max_recv_tokens, handle, quantize,
                expert_recv_stats, previous_event,
            )  # fmt: skip
            if self.agree_on_inputs:
                self._agree(call)
        except _Refused as refused:
            if self.agree_on_inputs:
                self._agree(call, refused.argument, refused.error)
            # No peer may wait for this rank, and every one must hear why.
            if new_layout:
                mode = max_recv_tokens if _is_count(max_recv_tokens) else None
                library.run_refused_dispatch(rt, refused.argument, mode)
            else:
                self._refuse_along(handle, "dispatch", f"{call}'s {refused.argument}")
            raise refused.error from None
        if new_layout and self._refused_along is not None:
            self._tell_refusal_along(max_recv_tokens)

        if new_layout:
            topk_idx = topk_idx.contiguous()
        if scaled and x_scales is None and x.requires_grad and torch.is_grad_enabled():
            # Straight through the quantization: the values are a ScaledValues.
            (recv_x, recv_scales, recv_weights, handle), event = self._launch(
                lambda: _counted(library.run_quantized_dispatch(
                    rt, self._id, x, topk_weights, topk_idx, pad_multiple, max_recv_tokens,
                    handle, scaled,
                ), expert_recv_stats),
                (x, topk_idx, topk_weights), previous_event, async_finish,
            )  # fmt: skip
        elif new_layout:
            (recv_x, recv_scales, recv_weights, handle), event = self._launch(
                lambda: _counted(library.run_dispatch(
                    rt, self._id, x, x_scales, topk_idx, topk_weights, pad_multiple,
                    max_recv_tokens, scaled,
                ), expert_recv_stats),
                (x, x_scales, topk_idx, topk_weights), previous_event, async_finish,
            )  # fmt: skip
        else:
            (recv_x, recv_scales, recv_weights), event = self._launch(
                lambda: library.run_dispatch_cached(
                    rt, self._id, x, x_scales, topk_weights, handle, scaled
                ),
                (x, x_scales, topk_weights), previous_event, async_finish,
            )  # fmt: skip
        if new_layout:
            self._track_overflow(handle)
        if recv_scales is not None:
            recv_x = recv_x, recv_scales
        if self.expand:
            outputs = recv_x, recv_weights, handle.tokens_per_expert, handle
        else:
            outputs = recv_x, handle.recv_topk_idx, recv_weights, handle.tokens_per_expert, handle
        return (*outputs, event) if async_finish else outputs

    def _checked_dispatch_inputs(
        self,
        x,
        topk_idx,
        topk_weights,
        pad_multiple,
        max_recv_tokens,
        handle,
        quantize,
        expert_recv_stats,
        previous_event,
    ) -> tuple[torch.Tensor, torch.Tensor | None, str | None]:
        """dispatch's checks: _Refused naming the argument that fails; returns the rows as the
        kernels read them, a pair's scales (or None) and the block-scaled format of recv_x
        (None: rows of the Buffer's dtype)."""
        rt = self._rt
        x_scales = None
        with _refusing("quantize"):
            scaled = check_quantize_format(
                "quantize", quantize, self.hidden_size, takes_bools=True,
                hint=" (pass rows quantized beforehand as a (values, scales) pair instead)",
            )  # fmt: skip
        with _refusing("x"):
            if isinstance(x, tuple):
                if scaled is not None:
                    raise ValueError(
                        f"quantize={quantize!r} takes rows of the Buffer's dtype, not a pair"
                    )
                x, x_scales, scaled = self._check_pair(x)
            else:
                self._check_tokens("x", x)
                x = _readable_rows(x)
        num_tokens = x.shape[0]
        if handle is None:
            with _refusing("topk_idx"):
                topk = self._check_routing(topk_idx, num_tokens)
            with _refusing("pad_multiple"):
                check_int("pad_multiple", pad_multiple, 1)
                if not self.expand and pad_multiple != 1:
                    raise ValueError(
                        f"pad_multiple must be 1 with expand=False (rows are tokens, not grouped "
                        f"by expert), got {pad_multiple}"
                    )
            if max_recv_tokens is not None:
                with _refusing("max_recv_tokens"):
                    check_int("max_recv_tokens", max_recv_tokens, 0)
        else:
            with _refusing("handle"):
                if x.shape[0] != handle.num_tokens:
                    raise ValueError(
                        f"x must have the handle's {handle.num_tokens} tokens, got {x.shape[0]}"
                    )
            topk = handle.topk
        if topk_weights is not None:
            with _refusing("topk_weights"):
                check_tensor("topk_weights", topk_weights, (num_tokens, topk), torch.float32,
                             rt.device)  # fmt: skip
        if expert_recv_stats is not None:
            with _refusing("expert_recv_stats"):
                if handle is not None:
                    raise ValueError("expert_recv_stats counts routing: pass it without a handle")
                check_tensor("expert_recv_stats", expert_recv_stats, (rt.plan.experts_per_rank,),
                             torch.int64, rt.device)  # fmt: skip
        with _refusing("previous_event"):
            self._check_event(previous_event)
        return x, x_scales, scaled

    def combine(
        self,
        y: torch.Tensor,
        handle: DispatchHandle,
        *,
        weights: torch.Tensor | None = None,
        previous_event: torch.cuda.Event | None = None,
        async_finish: bool = False,
    ):
        """Send expert outputs back to their tokens' ranks and sum them per token.

        Args:
            y: [N, H] expert outputs in recv_x's row order, the Buffer's dtype (with
                ``expand=False``: one row per received token, e.g. the weighted sum of its
                local experts' outputs).
            handle: the handle returned by the dispatch that produced recv_x.
            weights: [N] float32 per-row factors (e.g. recv_weights with ``expand=True``), or
                None for 1.
            previous_event, async_finish: as for ``dispatch``.
        A refused y, weights or previous_event: as for a dispatch along a handle.

        Returns:
            out: [T, H] in y's dtype, out[t] = sum over t's valid slots of weight * y[row],
            accumulated in fp32; zeros for a token without valid slots; padding rows ignored.
            event: only with async_finish: completes with the call.
        """
        self._check_usable_for("combine")
        if not self.agree_on_inputs:
            self._check_handle(handle)  # (without one of this Buffer's, no part in the call)
        rt = self._rt
        try:
            if self.agree_on_inputs:
                with _refusing("handle"):
                    self._check_handle(handle)
            with _refusing("y"):
                check_tensor("y", y, (handle.num_recv_rows, self.hidden_size), self.dtype,
                             rt.device)  # fmt: skip
                check_contiguous_rows("y", y)
            if weights is not None:
                with _refusing("weights"):
                    check_tensor("weights", weights, (handle.num_recv_rows,), torch.float32,
                                 rt.device)  # fmt: skip
            with _refusing("previous_event"):
                self._check_event(previous_event)
            if self.agree_on_inputs:
                self._agree("combine")
        except _Refused as refused:
            if self.agree_on_inputs:
                self._agree("combine", refused.argument, refused.error)
            self._refuse_along(handle, "combine", f"combine's {refused.argument}")
            raise refused.error from None
        y = _readable_rows(y)
        out, event = self._launch(
            lambda: library.run_combine(rt, self._id, y, weights, handle),
            (y, weights), previous_event, async_finish,
        )  # fmt: skip
        return (out, event) if async_finish else out

    # -- low-latency mode (decode) ---------------------------------------------------------

    def low_latency_dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        num_max_dispatch_tokens_per_rank: int,
        num_experts: int,
        cumulative_local_expert_recv_stats: torch.Tensor | None = None,
        use_fp8: bool = True,
        round_scale: bool = False,
        use_ue8m0: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
        previous_event: torch.cuda.Event | None = None,
    ):
        """DeepEP's low-latency dispatch: every token to its experts' ranks in one launch, into
        a fixed block of rows per local expert; no host synchronisation (README, Low-latency
        mode). Collective.

        Args:
            x: [T, H] tokens of the Buffer's dtype, T <= num_max_dispatch_tokens_per_rank.
            topk_idx: [T, K] int32/int64 global expert ids, -1 for an unused slot.
            num_max_dispatch_tokens_per_rank: M', the same on every rank, 1..low_latency_tokens.
            num_experts: E, the Buffer's.
            cumulative_local_expert_recv_stats: int32 [L] or None: adds each local expert's rows.
            use_fp8: rows as e4m3 values and a float32 scale per 128 channels (H % 128 == 0).
            round_scale: FP8 scales rounded up to powers of two.
            use_ue8m0: scales as UE8M0 exponents, four to an int32 (needs round_scale).
            async_finish, previous_event: as for ``dispatch``.
            return_recv_hook: launch the sends only; ``hook()`` launches the receive.

        Returns:
            recv_x: [L, W * M', H] of x's dtype, or with use_fp8 (values [L, W * M', H]
                float8_e4m3fn, scales [L, W * M', H / 128] float32 or [L, W * M', H / 512]
                int32), scales with the rows fastest; rows past recv_count[e] are not written.
            recv_count: [L] int32, rows of each local expert.
            handle: for ``low_latency_combine`` (src_info, layout_range first, as DeepEP's).
            event: with async_finish, else None. hook: with return_recv_hook, else None.
        """
        rt, call, area = self._start_low_latency_call("low_latency_dispatch", return_recv_hook)
        try:
            check_low_latency_dispatch(
                rt.plan, rt.device, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                cumulative_local_expert_recv_stats, use_fp8, round_scale, use_ue8m0,
            )  # fmt: skip
            self._check_event(previous_event)
        except ValueError:
            call[0] = False
            low_latency.run_refused_dispatch(rt, self._id, area)
            raise
        topk_idx = topk_idx.contiguous()  # (the kernels read it as [T, K], rows K apart)
        stats = cumulative_local_expert_recv_stats
        receive = not return_recv_hook
        outputs, event = self._launch(
            lambda: low_latency.dispatch(
                self._id, x, topk_idx, stats, num_max_dispatch_tokens_per_rank, use_fp8,
                round_scale, use_ue8m0, receive, area, False,
            ),
            (x, topk_idx, stats), previous_event, async_finish,
        )  # fmt: skip
        outputs = low_latency.DispatchOutputs(*outputs)
        hook = None
        if return_recv_hook:

            def hook() -> None:
                self._take_hook(call)
                low_latency.dispatch_receive(self._id, x, topk_idx, stats, *outputs,
                                             round_scale, use_ue8m0)  # fmt: skip

        recv_x = outputs.recv_x
        if use_fp8:
            recv_x = recv_x, low_latency.caller_scales(outputs.scale_storage)
        handle = low_latency.LowLatencyHandle(
            outputs.src_info, outputs.layout_range, num_max_dispatch_tokens_per_rank,
            self.hidden_size, self.num_experts, outputs.token_slots,
        )  # fmt: skip
        return recv_x, outputs.recv_count, handle, event, hook

    def low_latency_combine(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        handle: "low_latency.LowLatencyHandle",
        zero_copy: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
        out: torch.Tensor | None = None,
        previous_event: torch.cuda.Event | None = None,
    ):
        """DeepEP's low-latency combine: expert outputs back to their tokens, summed with the
        tokens' weights, in one launch. Collective.

        Args:
            x: [L, W * M', H] expert outputs of the Buffer's dtype in recv_x's rows; with
                zero_copy, the buffer ``get_next_low_latency_combine_buffer`` returned.
            topk_idx: [T, K], the dispatch's. topk_weights: [T, K] float32.
            handle: the dispatch's. zero_copy: x is that buffer (the experts wrote into it).
            async_finish, return_recv_hook, previous_event: as for ``low_latency_dispatch``.
            out: [T, H] of the Buffer's dtype to write into, or None.

        Returns:
            combined_x: [T, H], out[t] = sum over t's valid slots k of topk_weights[t, k] times
                its expert's row, accumulated in fp32; zeros for a token without valid slots.
            event, hook: as for ``low_latency_dispatch``.
        """
        rt, call, area = self._start_low_latency_call("low_latency_combine", return_recv_hook)
        try:
            if not isinstance(handle, low_latency.LowLatencyHandle) or (
                handle.src_info.device != rt.device or handle.hidden != self.hidden_size
            ):
                raise ValueError(
                    f"handle must be a low-latency dispatch's handle of this Buffer, got "
                    f"{describe(handle)}"
                )
            for name, flag in (("zero_copy", zero_copy), ("return_recv_hook", return_recv_hook),
                               ("async_finish", async_finish)):  # fmt: skip
                check_flag(name, flag)
            check_low_latency_combine(
                rt.plan, rt.device, x, topk_idx, topk_weights, handle.token_slots,
                handle.src_info.shape[1], out,
            )  # fmt: skip
            if (
                zero_copy
                and x.data_ptr()
                != low_latency.combine_buffer(
                    rt, handle.num_max_dispatch_tokens_per_rank, area
                ).data_ptr()
            ):
                raise ValueError(
                    "zero_copy takes the buffer that get_next_low_latency_combine_buffer "
                    "returned right before this call as x"
                )
            self._check_event(previous_event)
        except ValueError:
            call[0] = False
            low_latency.run_refused_combine(rt, self._id, area)
            raise
        topk_idx, topk_weights = topk_idx.contiguous(), topk_weights.contiguous()
        if out is None:
            out = torch.empty(topk_idx.shape[0], self.hidden_size, dtype=self.dtype,
                              device=rt.device)  # fmt: skip
        parts = (x, topk_idx, topk_weights, handle.token_slots, handle.layout_range, out)
        call_seq, event = self._launch(
            lambda: low_latency.combine(
                self._id, *parts, zero_copy, not return_recv_hook, area, False
            ),  # fmt: skip
            parts,
            previous_event,
            async_finish,
        )
        hook = None
        if return_recv_hook:

            def hook() -> None:
                self._take_hook(call)
                low_latency.combine_receive(self._id, *parts, call_seq)

        return out, event, hook

    def get_next_low_latency_combine_buffer(
        self, handle: "low_latency.LowLatencyHandle"
    ) -> torch.Tensor:
        """[L, W * M', H] of the Buffer's dtype in this rank's heap, for the experts to write
        their outputs into and the next low-latency call, a combine with zero_copy=True, to
        read (its area alternates with every low-latency call, as DeepEP's)."""
        rt = self._low_latency_runtime()
        return low_latency.combine_buffer(
            rt, handle.num_max_dispatch_tokens_per_rank, self._next_area
        )

    def clean_low_latency_buffer(
        self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int
    ) -> None:
        """DeepEP's call to zero its low-latency flags after other use of its buffer: nothing
        to do here (flags carry sequence numbers and normal mode has areas of its own); checks
        that the arguments fit the Buffer."""
        rt = self._low_latency_runtime()
        check_int("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank, 1,
                  rt.plan.low_latency.tokens)  # fmt: skip
        if (hidden, num_experts) != (self.hidden_size, self.num_experts):
            raise ValueError(
                f"hidden and num_experts must be the Buffer's ({self.hidden_size}, "
                f"{self.num_experts}), got ({hidden}, {num_experts})"
            )

    @staticmethod
    def low_latency_bytes(
        num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int,
        dtype: torch.dtype = torch.bfloat16,
    ) -> int:  # fmt: skip
        """Heap bytes a rank that ``low_latency_tokens`` adds for these sizes (compare DeepEP's
        ``get_low_latency_rdma_size_hint``; README, Low-latency mode)."""
        return low_latency_bytes(num_max_dispatch_tokens_per_rank, hidden, num_ranks,
                                 num_experts, dtype)  # fmt: skip

    def _low_latency_runtime(self):
        self._check_usable()
        if not self._rt.plan.low_latency.tokens:
            raise ValueError(
                "this Buffer has no low-latency mode: build it with low_latency_tokens=M"
            )
        return self._rt

    def _start_low_latency_call(self, name: str, return_recv_hook: bool):
        """The runtime, this call's cell [whether its receive hook is yet to be called] and
        its send area; ValueError if the receive hook of a call two calls back is yet to be
        called (its receive area is this call's)."""
        rt = self._low_latency_runtime()
        if len(self._last_calls) == 2 and self._last_calls[0][0]:
            raise ValueError(
                f"{name}: the receive hook of the low-latency call two calls back was not "
                "called; at most two calls may await their hooks (call them before the next)"
            )
        call = [return_recv_hook is True]
        self._last_calls = [*self._last_calls[-1:], call]
        area, self._next_area = self._next_area, 1 - self._next_area
        return rt, call, area

    def _take_hook(self, call: list[bool]) -> None:
        self._check_usable()
        if not call[0]:
            raise RuntimeError("this receive hook was called already")
        call[0] = False

    def check(self, handle: DispatchHandle | None = None) -> None:
        """Synchronise and raise what the device recorded for ``handle``'s dispatch (None, or a
        low-latency handle: of the low-latency calls so far).

        TimeoutError: a peer did not answer within timeout_s (the Buffer is then unusable);
        ValueError: some rank's topk_idx was invalid, or its host refused an input of this
            dispatch or of an earlier call along a handle (nothing was moved); of low-latency
            calls, a rank's host refused the inputs of one (its outputs are not valid);
        OverflowError: more rows were needed than max_recv_tokens (the excess was dropped).
        """
        if handle is None or isinstance(handle, low_latency.LowLatencyHandle):
            self._check_usable()
            status.check_low_latency(self._rt)
            return
        self._check_handle(handle)
        status.read_report(self._rt, handle)
        self._unchecked = [entry for entry in self._unchecked if entry[0] is not handle.state]
        if handle.max_recv_tokens is not None:
            self._raise_on_overflow([(handle.state, handle.max_recv_tokens)])

    @property
    def network_rows(self) -> int:
        """Token rows this rank has put over the network in its dispatches so far (one per
        (token, other node that holds one of its experts) and dispatch; 0 within one node).
        Synchronises."""
        return self._rt.network_rows

    @property
    def kernel_builds(self) -> int:
        """Kernel specialisations this Buffer's calls have taken so far. Triton compiles each at
        its first launch (seconds; tens of seconds where it links NVSHMEM's device library,
        across nodes) unless its cache has it: the token count's class (1, a multiple of 16,
        other), the mode, weights, the ids' dtype and the row format pick one, so the first
        calls of a job may compile several. 0 on CPU ranks (the interpreter compiles
        nothing)."""
        return self._rt.kernel_builds

    @property
    def kernel_build_seconds(self) -> float:
        """Host seconds this Buffer's calls have spent in the first launch of each kernel
        specialisation (see ``kernel_builds``): Triton compiling it, or loading it from its
        cache. A call that is slow while this grows was compiling; one that is slow while it
        stays was waiting (for a peer or the device). 0 on CPU ranks."""
        return self._rt.kernel_build_seconds

    def destroy(self) -> None:
        """Free the symmetric buffers (collective; idempotent)."""
        if getattr(self, "_rt", None) is not None:
            library.unregister(self._id)
            self._rt.heap.close()
            self._rt = None

    def __enter__(self) -> "Buffer":
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()

    # -- launching ------------------------------------------------------------------------

    def _launch(self, call, inputs, previous_event, async_finish):
        """Run ``call`` (returns a tensor or a tuple of tensors, None or handles) on the calling
        stream, or on the communication stream with async_finish; returns (outputs, event)."""
        if not async_finish or not self._rt.on_gpu:
            if previous_event is not None:
                torch.cuda.current_stream().wait_event(previous_event)
            return call(), None
        caller = torch.cuda.current_stream()
        if self._comm_stream is None:
            self._comm_stream = torch.cuda.Stream(self._rt.device)
        comm = self._comm_stream
        if previous_event is not None:
            comm.wait_event(previous_event)
        else:
            comm.wait_stream(caller)
        with torch.cuda.stream(comm):
            outputs = call()
        # The caching allocator must not hand these blocks to another stream while in use:
        # inputs are read on comm, outputs (allocated on comm) are used on the caller's stream.
        for t in inputs:
            if t is not None:
                t.record_stream(comm)
        for out in outputs if isinstance(outputs, tuple) else (outputs,):
            if isinstance(out, DispatchHandle):
                for part in (out.state, out.recv_topk_idx):
                    if part is not None:
                        part.record_stream(caller)
            elif out is not None:
                out.record_stream(caller)
        return outputs, comm.record_event()

    def _agree(self, call: str, argument: str = "", error: Exception | None = None) -> None:
        """agree_on_inputs: whether every rank's host passed its inputs of this ``call``
        (collective, on the host): if one refused ``argument`` (``error`` says why), that error
        on the refusing rank and a ValueError naming it on every other, before anything moves."""
        subject = f"its {call}'s {argument}" if argument else f"its {call}"
        _gather_or_refuse(self.group, None, error, subject)

    def _refuse_along(self, handle: DispatchHandle, call: str, argument: str) -> None:
        """This rank's host refused ``argument`` (ops/dispatch.ALONG_A_HANDLE) of a ``call``
        along ``handle``: run the call with zero rows, so that no peer waits for this rank, and
        remember the refusal for the next dispatch with a new layout to publish."""
        library.run_refused_call_along(self._rt, handle, call)
        if self._refused_along is None:  # (the first that the peers have not heard of)
            self._refused_along = argument

    def _tell_refusal_along(self, max_recv_tokens: int | None) -> None:
        """A dispatch with a new layout after a refused call along a handle: its layout
        publishes that refusal instead of this rank's counts, so that every rank raises
        ValueError (as for a refused input of this dispatch) and nothing moves."""
        argument, self._refused_along = self._refused_along, None
        library.run_refused_dispatch(self._rt, argument, max_recv_tokens)
        raise ValueError(
            f"rank {self._rt.rank} (this rank) refused its {argument} in an earlier call along a "
            "handle, so that call's outputs on the other ranks are not valid: this dispatch "
            "tells every rank and moved nothing (the next one goes ahead)"
        )

    def _track_overflow(self, handle: DispatchHandle) -> None:
        """Remember an unchecked max_recv_tokens dispatch; after an exact-mode one (which has
        synchronised already, once its collective work is done, so no peer is left waiting)
        raise the overflows of earlier ones."""
        if handle.max_recv_tokens is not None:
            if len(self._unchecked) < _MAX_UNCHECKED:
                self._unchecked.append((handle.state, handle.max_recv_tokens))
        elif self._unchecked:
            pending, self._unchecked = self._unchecked, []
            self._raise_on_overflow(pending)

    # -- checks -----------------------------------------------------------------------------

    def _check_event(self, event) -> None:
        if event is None:
            return
        if not self._rt.on_gpu or not isinstance(event, torch.cuda.Event):
            raise ValueError(
                f"previous_event must be a torch.cuda.Event on GPUs or None, got {describe(event)}"
            )

    def _check_usable_for(self, call: str) -> None:
        """_check_usable, told to every rank first with agree_on_inputs, whose peers would
        otherwise wait in the host collective of this ``call``."""
        try:
            self._check_usable()
        except RuntimeError as error:
            if self.agree_on_inputs:
                self._agree(call, error=error)
            raise

    def _check_usable(self) -> None:
        if self._rt is None:
            raise RuntimeError("this Buffer was destroyed")
        if self._rt.broken is not None:
            raise RuntimeError(f"this Buffer is unusable after an earlier error: {self._rt.broken}")

    def _check_tokens(
        self, name: str, x: torch.Tensor, dtype: torch.dtype | None = None, cols: int | None = None
    ) -> None:
        """x: [T, cols] (default: [T, H]) of ``dtype`` (default: the Buffer's), T <=
        max_tokens_per_rank."""
        check_tensor(name, x, None, dtype or self.dtype, self._rt.device)
        shape = x.shape
        cols = cols or self.hidden_size
        if len(shape) != 2 or shape[1] != cols:
            raise ValueError(f"{name} must be a [T, {cols}] tensor, got {tuple(shape)}")
        if shape[0] > self.max_tokens_per_rank:
            raise ValueError(
                f"{name} has {shape[0]} tokens, more than max_tokens_per_rank="
                f"{self.max_tokens_per_rank}"
            )
        check_contiguous_rows(name, x)

    def _check_pair(self, pair) -> tuple[torch.Tensor, torch.Tensor, str]:
        """A (values, scales) pair of rows of a block-scaled format, checked; returns values,
        scales and the format's name."""
        if len(pair) != 2:
            raise ValueError(
                f"block-scaled rows are a pair (values, scales), got {len(pair)} items"
            )
        values, scales = pair
        if not self._rt.plan.scaled:
            blocks = ", ".join(f"{f.block} ({f.name})" for f in SCALED_FORMATS.values())
            raise ValueError(
                f"block-scaled rows need a hidden size that is a multiple of {blocks}, this "
                f"Buffer's is {self.hidden_size}"
            )
        if isinstance(values, ScaledValues):
            raise ValueError(
                "a pair's values must be a plain tensor, got a ScaledValues (the values of a "
                "quantizing dispatch of rows that require grad): pass its .quantized, which "
                "carries no gradient, or the ScaledValues alone as rows of its dtype"
            )
        dtypes = (getattr(values, "dtype", None), getattr(scales, "dtype", None))
        fmt = next((f for f in SCALED_FORMATS.values() if dtypes == _pair_dtypes(f)), None)
        if fmt is None:
            known = ", ".join(f"{f.name} {_pair_dtypes(f)}" for f in SCALED_FORMATS.values())
            raise ValueError(
                f"a pair's (values, scales) dtypes name its format, one of {known}; got "
                f"({describe(values)}, {describe(scales)})".replace("torch.", "")
            )
        if self._rt.plan.scaled_rows(fmt.name) is None:
            raise ValueError(
                f"{fmt.name} rows need a hidden size that is a multiple of {fmt.block} (and of "
                f"{4 * fmt.channels_per_byte}), this Buffer's is {self.hidden_size}"
            )
        self._check_tokens(f"{fmt.name} values", values, fmt.values_dtype,
                           fmt.values_shape(0, self.hidden_size)[1])  # fmt: skip
        scales_shape = fmt.scales_shape(values.shape[0], self.hidden_size)
        check_tensor(f"{fmt.name} scales", scales, scales_shape, fmt.scale_dtype, self._rt.device)
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
        return values, scales, fmt.name

    def _check_routing(self, topk_idx: torch.Tensor | None, num_tokens: int) -> int:
        if topk_idx is None:
            raise ValueError("topk_idx is required without a handle")
        if not isinstance(topk_idx, torch.Tensor) or topk_idx.dim() != 2:
            raise ValueError(f"topk_idx must be a [T, K] tensor, got {describe(topk_idx)}")
        if topk_idx.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"topk_idx must be int32 or int64, got {topk_idx.dtype}")
        topk = topk_idx.shape[1]
        check_tensor("topk_idx", topk_idx, (num_tokens, topk), topk_idx.dtype, self._rt.device)
        if topk < 1:
            raise ValueError("topk_idx must have at least one slot per token (K >= 1)")
        if min(topk, self._rt.plan.experts_per_rank) > self._rt.plan.meta_stride:
            raise ValueError(
                f"topk_idx has K={topk} slots; with {self._rt.plan.experts_per_rank} experts per "
                f"rank at most {MAX_TOPK} are supported"
            )
        return topk

    def _check_handle(self, handle) -> None:
        if not isinstance(handle, DispatchHandle) or handle.state.device != self._rt.device:
            raise ValueError(
                f"handle must be a DispatchHandle of this Buffer, got {describe(handle)}"
            )

    def _raise_on_overflow(self, dispatches: list[tuple[torch.Tensor, int]]) -> None:
        """Raise OverflowError for the first of ``dispatches`` (a handle's state, M) that needed
        more than M rows."""
        needed = torch.stack([state[0] for state, _ in dispatches]).tolist()
        for (_, limit), rows in zip(dispatches, needed, strict=True):
            if rows > limit:
                raise OverflowError(
                    f"rank {self._rt.rank}: a dispatch needed {rows} rows but max_recv_tokens is "
                    f"{limit}; the rows past it were dropped. Size max_recv_tokens as "
                    "world * max_tokens_per_rank * min(K, L) + L * (pad_multiple - 1) to never "
                    "drop a row"
                )


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


class _Refused(Exception):
    """The host refused a dispatch ``argument``: ``error`` is the ValueError that says why."""

    def __init__(self, argument: str, error: ValueError):
        super().__init__(argument)
        self.argument, self.error = argument, error


class _refusing:
    """``with _refusing(argument):`` checks of ``argument``: their ValueError becomes a _Refused
    naming it. A class, not a contextlib.contextmanager: every dispatch and combine enters
    several, and on a 2-core x86 host a generator's cost 1.3 µs each, a class's 0.25 µs."""

    __slots__ = ("argument",)

    def __init__(self, argument: str):
        self.argument = argument

    def __enter__(self) -> None:
        pass

    def __exit__(self, kind, error, traceback) -> None:
        if kind is not None and issubclass(kind, ValueError):
            raise _Refused(self.argument, error) from None


def _pair_dtypes(fmt: ScaledFormat) -> tuple[torch.dtype, torch.dtype]:
    return fmt.values_dtype, fmt.scale_dtype


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _counted(outputs: tuple, expert_recv_stats: torch.Tensor | None) -> tuple:
    """A new-layout dispatch's outputs (their last item the handle), after adding its tokens
    routed to each local expert (the handle's valid rows per expert) into the statistics."""
    if expert_recv_stats is not None:
        expert_recv_stats.add_(outputs[-1].expert_layout[1])
    return outputs


def _readable_rows(rows: torch.Tensor) -> torch.Tensor:
    """``rows``, or for a ScaledValues (no storage of its own for a kernel to read) its
    dequantized rows, as every torch op sees them, with its gradient."""
    return rows.dequantize() if isinstance(rows, ScaledValues) else rows


def _token_device(device: torch.device | str | None, group: dist.ProcessGroup) -> torch.device:
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


def _check_parameters(world, hidden_size, max_tokens_per_rank, num_experts, dtype, num_sms,
                      timeout_s, expand, ranks_per_node, device,
                      agree_on_inputs) -> None:  # fmt: skip
    """Buffer's parameters as this rank sees them alone: ValueError naming the first bad one."""
    if ranks_per_node is not None:
        check_int("ranks_per_node", ranks_per_node, 1, world)
        if world % ranks_per_node:
            raise ValueError(
                f"ranks_per_node must divide the group size {world}, got {ranks_per_node}"
            )
    check_int("hidden_size", hidden_size, 1)
    check_int("max_tokens_per_rank", max_tokens_per_rank, 0)
    check_int("num_experts", num_experts, 1)
    if num_experts % world:
        raise ValueError(
            f"num_experts must be divisible by the group size {world}, got {num_experts}"
        )
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {dtype}")
    if num_sms is not None:
        check_int("num_sms", num_sms, 1, MAX_SMS)
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    for name, flag in (("expand", expand), ("agree_on_inputs", agree_on_inputs)):
        if not isinstance(flag, bool):
            raise ValueError(f"{name} must be True or False, got {describe(flag)}")
    check_interpreted_on_cpu(device)


def _gather_or_refuse(
    group: dist.ProcessGroup, value, refused: Exception | None,
    subject: str = "the Buffer's parameters",
) -> list:  # fmt: skip
    """Every rank's ``value`` (collective), unless some rank's host refused ``subject``
    (``refused`` says why): then a ValueError on every rank, the refusing rank's own, the others
    naming the first refusing rank, its subject and its reason."""
    everyone = [None] * dist.get_world_size(group)
    said = None if refused is None else f"{subject}: {refused}"
    dist.all_gather_object(everyone, (value, said), group=group)
    if refused is not None:
        raise refused from None  # (raised while handling a _Refused, say: that is not news)
    for r, (_, said) in enumerate(everyone):
        if said is not None:
            raise ValueError(f"rank {r} refused {said}")
    return [v for v, _ in everyone]


def _check_same_on_all_ranks(
    group: dist.ProcessGroup, refused: ValueError | None, **params
) -> None:
    everyone = _gather_or_refuse(group, params, refused)
    for key, value in params.items():
        values = [p[key] for p in everyone]
        if any(v != value for v in values):
            raise ValueError(f"{key} differs between ranks: {values} (rank order)")
