"""A Buffer's runtime: its symmetric heap, control block, host records and launchers, what
every launch needs."""

import itertools
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from ..kernels.control import CONTROL_WORDS, NET_ROWS, REPORT_EXPERTS
from ..kernels.primitives import HOST_RECORD_WORDS
from ..runtime.checks import (
    BufferOptions,
    check_parameters,
    check_same_on_all_ranks,
    gather_or_refuse,
    ranks_per_host,
    token_device,
)
from ..runtime.heap import allocate_heap
from ..runtime.planner import Plan, make_plan
from ..runtime.tuning import cache_key, select_config
from .launch import KernelLauncher

# Programs of the local kernels on CPU ranks (on GPUs: the config's programs_per_sm per SM).
_CPU_LOCAL_PROGRAMS = 2


@dataclass
class Runtime:
    """What every launch needs from its Buffer.

    heap: the symmetric heap (``local`` uint8 tensor, ``peer_bases`` int64 [world]: 0 for the
        ranks of other nodes, ``net_bases`` int64 [world]: addresses for network puts).
    control: int64 [CONTROL_WORDS] on the device, the control block: its words are named in
        kernels/control.py.
    on_gpu: whether ``device`` is a CUDA device (else the CPU, under the interpreter).
    timeout_ns: bound of every wait on a peer, in nanoseconds.
    local_programs: programs of a launch for the work that stays on this GPU (expansion,
        reduction, finish): the config's programs_per_sm per SM; the senders are taken from it.
    outbox: [W * T_MAX, H] of the Buffer's dtype: combine's partial rows for the other ranks,
        laid out like the heap's staging area.
    report: int64 [REPORT_EXPERTS + L] in host memory (pinned on GPUs, which the device writes
        through its mapping): what an exact-mode layout writes for the host, the REPORT_* words
        of kernels/control.py; ``report_words`` is a memoryview of it (ops/status.py reads it).
    broken: why the Buffer is unusable (a wait timed out: ops/status.py), or None.
    outputs_record: int64 [8] in host memory (pinned on GPUs, which the device reads through
        its mapping): the row count and output addresses of an exact-mode dispatch's data move,
        written by the host once it knows them (ops/dispatch.PreparedMove);
        ``outputs_record_words`` is a memoryview of it.
    compile_options: options of every launch beside the kernel's own (across nodes on GPUs:
        NVSHMEM's device library, ``extern_libs``).
    on_compile: called with each newly compiled kernel before its first launch (across nodes on
        GPUs: NVSHMEM's module initialisation), or None.
    launchers: the Buffer's KernelLauncher of each kernel, by the function that makes it
        (see ``launcher``).
    relaunches: the last launch of each kind of call as a Relaunch (see ops/launch.py), by
        what fixes the arguments a repeated call does not change (the kind, the token count,
        K, flags): at most a few per distinct token count.
    ll_scratch: int32 [B * S, M] on the device: the low-latency send role's lists of rows
        (kernels/low_latency.py), [0] without the mode.
    """

    plan: Plan
    heap: object
    control: torch.Tensor
    rank: int
    world_size: int
    device: torch.device
    timeout_ns: int
    local_programs: int
    outbox: torch.Tensor
    group: dist.ProcessGroup
    report: torch.Tensor
    outputs_record: torch.Tensor
    ll_scratch: torch.Tensor
    compile_options: dict = field(default_factory=dict)
    on_compile: Callable | None = None
    launchers: dict = field(default_factory=dict)
    broken: str | None = None
    relaunches: dict = field(default_factory=dict)
    _report_calls: Iterator[int] = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        # Read on every call: a torch.device's ``type`` costs more host time than an attribute.
        self.on_gpu = self.device.type == "cuda"
        # Memoryviews: the host reads and writes their items on every exact-mode call, and a
        # memoryview's items cost less host time than a numpy array's or a tensor's.
        self.report_words = memoryview(self.report.numpy())
        self.outputs_record_words = memoryview(self.outputs_record.numpy())
        # Made here, not on first use, which may be inside a CUDA graph capture.
        self._placeholders = {
            dtype: torch.zeros(16, dtype=torch.uint8, device=self.device).view(dtype)
            for dtype in (
                torch.float32,
                torch.int32,
                torch.int64,
                torch.float8_e4m3fn,
                self.outbox.dtype,
            )
        }

    def placeholder(self, dtype: torch.dtype) -> torch.Tensor:
        """16 bytes of ``dtype`` (float32, int32, int64, float8_e4m3fn or the Buffer's dtype) on the
        device: a pointer argument of that type that a launch does not use."""
        return self._placeholders[dtype]

    def next_report_tag(self) -> int:
        """The tag of this Buffer's next exact-mode layout report (see ``report_tag``)."""
        return report_tag(next(self._report_calls))

    @property
    def network_rows(self) -> int:
        """Token rows this rank has put over the network in its dispatches (synchronises)."""
        return int(self.control[int(NET_ROWS)])

    @property
    def kernel_builds(self) -> int:
        """Kernel specialisations this runtime's launches have taken so far."""
        return sum(launcher.builds for launcher in self.launchers.values())

    @property
    def kernel_build_seconds(self) -> float:
        """Host seconds this runtime's launches have spent in first launches (compiling)."""
        return sum(launcher.build_seconds for launcher in self.launchers.values())

    def launcher(self, make: Callable[["Runtime"], KernelLauncher]) -> KernelLauncher:
        """The launcher ``make(self)`` returns, made on first use."""
        found = self.launchers.get(make)
        if found is None:
            found = self.launchers[make] = make(self)
        return found


def make_runtime(
    plan: Plan,
    group: dist.ProcessGroup,
    device: torch.device,
    timeout_s: float,
    sms: int | None,
    heap=None,
) -> Runtime:
    """A Buffer's runtime: its symmetric heap (collective over ``group``; ``heap``: one made
    earlier, zero-filled, at least the plan's size), control block, report, host record and
    outbox, on ``device``; ``sms``: the SMs this process's context may use on a GPU (None on
    CPU ranks)."""
    on_gpu = device.type == "cuda"
    ll = plan.low_latency
    compile_options, on_compile = nvshmem_linking(device, plan.nodes)
    if heap is None:
        heap = allocate_heap(group, plan.heap.total_bytes, device, plan.ranks_per_node)
    return Runtime(
        plan=plan,
        heap=heap,
        control=torch.zeros(CONTROL_WORDS, dtype=torch.int64, device=device),
        rank=dist.get_rank(group),
        world_size=plan.world_size,
        device=device,
        timeout_ns=int(timeout_s * 1e9),
        local_programs=sms * plan.config.programs_per_sm if on_gpu else _CPU_LOCAL_PROGRAMS,
        outbox=torch.empty(
            plan.world_size * max(plan.max_tokens, 1), plan.hidden, dtype=plan.dtype, device=device
        ),
        group=group,
        report=torch.zeros(
            int(REPORT_EXPERTS) + plan.experts_per_rank,
            dtype=torch.int64,
            device="cpu",
            pin_memory=on_gpu,
        ),
        outputs_record=torch.zeros(
            int(HOST_RECORD_WORDS), dtype=torch.int64, device="cpu", pin_memory=on_gpu
        ),
        ll_scratch=torch.empty(
            ll.remote_blocks * ll.slices * ll.tokens,
            dtype=torch.int32,
            device=device,
        ),
        compile_options=compile_options,
        on_compile=on_compile,
    )


def nvshmem_linking(device: torch.device, nodes: int) -> tuple[dict, Callable | None]:
    """(compile options, on_compile) of the kernels of a heap on ``device`` spanning ``nodes``
    nodes: across nodes on GPUs they call NVSHMEM, so they link its device library and set up
    each module; else nothing. Checks first that the library is there: otherwise the first
    launch would fail to compile, on every rank."""
    if device.type != "cuda" or nodes == 1:
        return {}, None
    import triton

    from ..runtime.cuda_packages import check_device_bitcode
    from ..runtime.nvshmem import init_module
    from ..runtime.nvshmem_bitcode import device_library

    check_device_bitcode(triton.__version__)
    return {"extern_libs": device_library()}, init_module


def report_tag(call: int) -> int:
    """The tag of exact-mode call number ``call``'s layout report: never the previous call's
    (the host must not take the previous report for this one's), odd and above 1, so that every
    tag takes the same kernel specialisation, and in int32 range."""
    return 3 + 2 * (call % (1 << 29))


def agreed_plan(
    group: dist.ProcessGroup, options: BufferOptions, ranks_per_node: int | None = None
) -> tuple[Plan, torch.device, int | None]:
    """Buffer's constructor up to its allocations (collective): every rank's parameters checked
    and agreed (a refusal on any rank is a ValueError on every rank), the kernel configuration
    chosen, the plan made. Returns the plan, the resolved device and the SMs this process's
    CUDA context may use (None on CPU ranks).

    With ``ranks_per_node`` (a reserved heap's, for options without one) there is no
    collective: a refusal is this rank's ValueError alone, and the configuration is the default
    one (no rank's tuning cache), so that ranks passing the same parameters make the same
    plan."""
    world = dist.get_world_size(group)
    collective = ranks_per_node is None
    try:
        device = token_device(options.device, group)
        check_parameters(world, replace(options, device=device))
        refused = None
    except ValueError as error:
        refused = error
    if collective:
        # Every rank gathers the host names (so that ranks passing and not passing
        # ranks_per_node make the same collectives) and whether it refused its parameters: a
        # refusal on any rank is a ValueError on every rank.
        hosts = gather_or_refuse(group, socket.gethostname(), refused)
        ranks_per_node = options.ranks_per_node or ranks_per_host(hosts)
    else:
        if refused is not None:
            raise refused
        ranks_per_node = options.ranks_per_node or ranks_per_node
    on_gpu = device.type == "cuda"
    # The SMs this process's context may use: under an MPS share (ranks sharing a GPU) the
    # context reports and gets that share alone.
    context_sms = torch.cuda.get_device_properties(device).multi_processor_count if on_gpu else None
    key = cache_key(
        device, world, options.hidden_size, options.dtype, options.expand, ranks_per_node
    )
    config = select_config(
        key,
        options.hidden_size,
        options.max_tokens_per_rank,
        options.num_sms,
        on_gpu,
        available_sms=context_sms,
        cached=collective,
    )
    if on_gpu and config.num_sms > context_sms:
        refused = ValueError(
            f"num_sms={config.num_sms} is more than the {context_sms} SMs this process's "
            f"CUDA context may use (an MPS share, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, gives "
            "a context part of the GPU)"
        )
    if collective:
        check_same_on_all_ranks(
            group,
            refused,
            hidden_size=options.hidden_size,
            max_tokens_per_rank=options.max_tokens_per_rank,
            num_experts=options.num_experts,
            dtype=options.dtype,
            num_sms=config.num_sms,
            expand=options.expand,
            ranks_per_node=ranks_per_node,
            device_type=device.type,
            agree_on_inputs=options.agree_on_inputs,
            low_latency_tokens=options.low_latency_tokens,
            mask_failed_ranks=options.mask_failed_ranks,  # (the layouts' agreement on masks)
            kernel_config=config,  # from each rank's tuning cache: must agree too
        )
    elif refused is not None:
        raise refused
    plan = make_plan(
        world,
        options.hidden_size,
        options.max_tokens_per_rank,
        options.num_experts,
        options.dtype,
        config,
        token_rows=not options.expand,
        ranks_per_node=ranks_per_node,
        low_latency_tokens=options.low_latency_tokens,
    )
    return plan, device, context_sms
