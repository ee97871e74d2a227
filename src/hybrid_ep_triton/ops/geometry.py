"""Launch geometry shared by the dispatch and combine launches: how many programs of each role,
column parts, the arguments both data moves bind for a Buffer, and the topology's
constexprs."""

from ..runtime.planner import (
    LOCAL_PARTS,
    MAX_PROGRAMS,
    MAX_REGISTERS,
    Plan,
    ceil_div,
    next_power_of_2,
)
from .runtime import Runtime


def channel_programs(plan: Plan) -> int:
    """Programs of a data-move launch that talk to other ranks: the senders and, across nodes,
    as many again for the network side (dispatch's forwarders, combine's network senders)."""
    return plan.config.senders * (2 if plan.nodes > 1 else 1)


def programs_beside_senders(rt: Runtime) -> int:
    """Programs for the local roles of a data-move launch: the room the channels leave, so that
    the launch is one wave on a GPU; at least half of ``local_programs``, and at least 2
    (combine has two local roles)."""
    return max(rt.local_programs - channel_programs(rt.plan), rt.local_programs // 2, 2)


def local_parts(plan: Plan, block_h: int, cols: int | None = None) -> int:
    """Column parts of a work item for the local roles: up to LOCAL_PARTS, at least one tile of
    ``block_h`` columns each, of rows of ``cols`` columns (default: the hidden size)."""
    tiles = ceil_div(ceil_div(cols or plan.hidden, plan.config.h_slices), block_h)
    return max(1, min(tiles, LOCAL_PARTS))


def topology_constants(plan: Plan, *names: str) -> dict:
    """The constexprs ``names`` of the node topology: R (ranks per node), NODES, and their
    powers of 2, R_P2 and N_P2."""
    values = dict(
        R=plan.ranks_per_node,
        NODES=plan.nodes,
        R_P2=next_power_of_2(plan.ranks_per_node),
        N_P2=next_power_of_2(plan.nodes),
    )
    return {name: values[name] for name in names}


def data_move_arguments(rt: Runtime) -> dict:
    """What dispatch's and combine's data moves both take and a Buffer fixes: its rank, heap
    regions, control block and bound of every wait, its senders, and their shared constexprs
    (by the names the kernels give them: of the node topology and of a NetSlot but its
    columns, which each move's rows set), with KernelLauncher's on_compile and the compile
    options."""
    plan, cfg, heap = rt.plan, rt.plan.config, rt.plan.heap
    return dict(
        on_compile=rt.on_compile,
        rank=rt.rank,
        num_senders=cfg.senders,
        peer_bases_ptr=rt.heap.peer_bases,
        chunk_flags_off=heap.chunk_flags,
        staging_off=heap.staging,
        control_ptr=rt.control,
        timeout_ns=rt.timeout_ns,
        mask_off=heap.mask,
        net_bases_ptr=rt.heap.net_bases,
        net_flags_off=heap.net_flags,
        net_inbox_off=heap.net_inbox,
        net_outbox_off=heap.net_outbox,
        heap_bytes=heap.total_bytes,
        W=rt.world_size,
        T_MAX=plan.max_tokens,
        NC_MAX=plan.max_chunks,
        H_SLICES=cfg.h_slices,
        P_MAX=MAX_PROGRAMS,
        MS=plan.meta_stride,
        MS_P2=next_power_of_2(plan.meta_stride),
        W_P2=next_power_of_2(rt.world_size),
        CHUNK=cfg.chunk_tokens,
        STAGES=cfg.copy_stages,
        DATA_OFF=plan.net_slot.data_offset,
        SLOT_BYTES=plan.net_slot.bytes,
        **topology_constants(plan, "R", "NODES", "R_P2"),
        num_warps=cfg.num_warps,
        maxnreg=MAX_REGISTERS,
        **rt.compile_options,
    )
