"""GPU side of the symmetric heap: NVSHMEM through nvshmem4py (``nvshmem4py-cu12`` or ``-cu13``
0.4.1, the one of torch's CUDA major: ``cuda_packages`` checks it before NVSHMEM is imported).

One NVSHMEM world per process, bootstrapped with the unique-id (UID) method over an existing
``torch.distributed`` group: NVSHMEM PE number == rank in that group. Each
:class:`NvshmemAllocation` is one ``nvshmem_malloc`` block, exposed as a ``uint8`` tensor plus
the int64 base address of every rank's block as mapped into this process (NVLink peer
mapping, ``nvshmem_ptr``), so Triton kernels can load/store peers' memory directly.

``nvshmem`` and ``cuda.core`` are imported lazily, inside the functions, so importing this
module (and the package) never touches them and works on a machine without CUDA.

nvshmem4py API used (checked against the 0.4.1 wheel's own source, ``nvshmem/core/*.py``):

* ``nvshmem.core.get_unique_id(empty: bool)`` -> ``UniqueID``; the 128-byte struct is
  reachable as ``uid._data`` (a numpy record array), which is what NVIDIA's UID example
  broadcasts: https://docs.nvidia.com/nvshmem/api/api/language_bindings/python/initialization.html
* ``nvshmem.core.init(device=cuda.core.Device, uid=..., rank=..., nranks=...,
  initializer_method="uid")``, ``nvshmem.core.finalize()``, ``my_pe()``, ``n_pes()``:
  same page (``nvshmem/core/init_fini.py``, ``nvshmem/core/direct.py``).
* ``nvshmem.core.tensor(shape, dtype=...)``, ``nvshmem.core.get_peer_tensor(t, peer_pe)``,
  ``nvshmem.core.free_tensor(t)``:
  https://docs.nvidia.com/nvshmem/api/api/language_bindings/python/interoperability.html
  (``nvshmem/core/interop/torch.py``). ``get_peer_tensor`` wraps ``nvshmem_ptr`` and raises
  ``NvshmemError`` when it returns NULL, i.e. the peer is not load/store reachable.
* ``NVSHMEM_SYMMETRIC_SIZE`` (bytes, default 1 GiB):
  https://docs.nvidia.com/nvshmem/api/gen/env.html
"""

from __future__ import annotations

import atexit
import os
import sys
from typing import NamedTuple

import torch
import torch.distributed as dist

from .cuda_packages import check_cuda_packages

__all__ = [
    "NvshmemAllocation",
    "ensure_initialized",
    "finalize",
    "init_module",
    "is_initialized",
]

_MiB = 1 << 20
# NVSHMEM keeps its own symmetric objects (team psync arrays, reduction scratch, signals) in
# the same heap, and the allocator rounds and aligns each block: leave headroom above what
# the caller asked for.
_HEAP_MARGIN_BYTES = 128 * _MiB
_HEAP_ALIGN = 2 * _MiB
_DEFAULT_HEAP_BYTES = 1024 * _MiB  # NVSHMEM's own default NVSHMEM_SYMMETRIC_SIZE


class _World(NamedTuple):
    ranks: tuple[int, ...]  # global ranks of the bootstrap group; index == NVSHMEM PE
    rank: int  # this process's rank in the group == its PE
    device: torch.device


_WORLD: _World | None = None
_FINALIZED = False  # NVSHMEM cannot be brought back up in a process once finalised
# A peer is gone (NvshmemAllocation.abandon): NVSHMEM's collective frees and finalisation would
# wait for it forever, so what is allocated stays until the process ends.
_ABANDONED = False
_ATEXIT_REGISTERED = False
# Open allocations by creation serial, so finalize() frees them in the same order on every
# rank. Strong references: an unclosed block stays allocated in NVSHMEM anyway (nvshmem4py
# tracks it) until freed collectively, never by garbage collection.
_OPEN: dict[int, NvshmemAllocation] = {}


def is_initialized() -> bool:
    """True between a successful :func:`ensure_initialized` and :func:`finalize`."""
    return _WORLD is not None


def _norm_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    return dist.group.WORLD if group is None else group


def _norm_device(device: torch.device | str | int) -> torch.device:
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"NVSHMEM needs a CUDA device, got {device}")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _comm_device(group: dist.ProcessGroup, device: torch.device) -> torch.device:
    # NCCL only moves CUDA tensors; gloo (tests) only CPU ones.
    return device if "nccl" in str(dist.get_backend(group)).lower() else torch.device("cpu")


def _heap_size_for(heap_bytes: int) -> int:
    want = int(heap_bytes) + max(_HEAP_MARGIN_BYTES, int(heap_bytes) // 16)
    return -(-want // _HEAP_ALIGN) * _HEAP_ALIGN


def ensure_initialized(
    group: dist.ProcessGroup | None,
    device: torch.device | str | int,
    heap_bytes: int | None = None,
) -> None:
    """Initialise NVSHMEM for this process once (collective over ``group`` on first call).

    Args:
        group: ``torch.distributed`` group (NCCL) whose ranks become the NVSHMEM PEs, PE ==
            rank in ``group``. ``None`` means the default group.
        device: this rank's CUDA device; made current (torch and CUDA driver).
        heap_bytes: total bytes of symmetric allocations this process intends to make. If
            given and ``NVSHMEM_SYMMETRIC_SIZE`` is not already set, the heap is sized to
            ``heap_bytes`` plus a margin (max(128 MiB, heap_bytes/16), rounded up to 2 MiB).
            Only the first call can influence it: NVSHMEM reads the variable at init.

    Raises:
        RuntimeError: if NVSHMEM was already initialised in this process for a group with
            other ranks or for another device (one NVSHMEM world per process).
        ImportError: on the first call, if nvshmem4py is not installed or a CUDA package is
            not for torch's CUDA major (``cuda_packages.check_cuda_packages``).
    """
    global _WORLD, _ATEXIT_REGISTERED
    if _FINALIZED:
        raise RuntimeError("NVSHMEM was finalised in this process and cannot be re-initialised")
    group = _norm_group(group)
    device = _norm_device(device)
    ranks = tuple(dist.get_process_group_ranks(group))
    if _WORLD is not None:
        if _WORLD.ranks != ranks or _WORLD.device != device:
            raise RuntimeError(
                "NVSHMEM is already initialised in this process for global ranks "
                f"{list(_WORLD.ranks)} on {_WORLD.device}; asked again for ranks {list(ranks)} "
                f"on {device}. Only one NVSHMEM world per process is supported: use the same "
                "group (and device) for every symmetric-heap allocation."
            )
        return

    # Before NVSHMEM is first imported: a package of another CUDA major would fail inside it.
    check_cuda_packages(torch.__version__, torch.version.cuda)
    rank, nranks = dist.get_rank(group), dist.get_world_size(group)
    torch.cuda.set_device(device)
    # NVSHMEM reads its options when the library first initialises: set them before any call.
    if heap_bytes is not None and "NVSHMEM_SYMMETRIC_SIZE" not in os.environ:
        os.environ["NVSHMEM_SYMMETRIC_SIZE"] = str(_heap_size_for(heap_bytes))
    # We only load/store through nvshmem_ptr peer mappings and never use multicast (NVLS)
    # objects; NVLS setup fails on machines without multicast support, so keep it off
    # unless the user decided otherwise.
    os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

    import numpy as np
    import nvshmem.core as nvshmem
    from cuda.core import Device

    cu_dev = Device(device.index)
    # Makes the primary context (the one torch uses) current for the driver calls NVSHMEM
    # makes during init.
    cu_dev.set_current()

    # Rank 0 creates the id; everyone else fills an empty one from the broadcast. The id is a
    # plain 128-byte struct, so send its bytes (no pickling of the Cython object).
    uid = nvshmem.get_unique_id(empty=(rank != 0))
    uid_bytes = uid._data.view(np.uint8)  # writable view of the struct, 128 B
    payload = torch.frombuffer(bytearray(uid_bytes.tobytes()), dtype=torch.uint8)
    payload = payload.to(_comm_device(group, device))
    dist.broadcast(payload, src=ranks[0], group=group)
    uid_bytes[:] = np.frombuffer(payload.cpu().numpy().tobytes(), dtype=np.uint8)

    nvshmem.init(device=cu_dev, uid=uid, rank=rank, nranks=nranks, initializer_method="uid")
    if nvshmem.my_pe() != rank or nvshmem.n_pes() != nranks:
        raise RuntimeError(
            f"NVSHMEM init mismatch: pe {nvshmem.my_pe()}/{nvshmem.n_pes()}, expected "
            f"{rank}/{nranks}"
        )
    _WORLD = _World(ranks=ranks, rank=rank, device=device)
    if not _ATEXIT_REGISTERED:
        # atexit runs last-in first-out: registered after torch's import-time handlers, it
        # runs before them, while the CUDA context is alive. It never uses torch.distributed.
        atexit.register(_finalize_at_exit)
        _ATEXIT_REGISTERED = True


def finalize() -> None:
    """Free live allocations and finalise NVSHMEM. Collective; idempotent.

    Uses no ``torch.distributed`` call (NVSHMEM's own bootstrap carries the barriers), so it
    is safe after ``destroy_process_group``. Every rank must call it (or reach process exit);
    a rank that dies first leaves the others waiting here, so exit failed ranks with
    ``os._exit``.
    """
    global _WORLD, _FINALIZED
    if _WORLD is None or _ABANDONED:
        return
    for serial in sorted(_OPEN):
        _OPEN[serial].close()
    import nvshmem.core as nvshmem

    torch.cuda.synchronize(_WORLD.device)
    _WORLD, _FINALIZED = None, True
    nvshmem.finalize()


def _finalize_at_exit() -> None:
    try:
        finalize()
    except Exception as exc:  # exiting anyway: report, do not mask the real exit status
        print(f"hybrid_ep_triton: NVSHMEM finalize at exit failed: {exc!r}", file=sys.stderr)


_serial_counter = 0


class NvshmemAllocation:
    """One symmetric ``nvshmem_malloc`` block of ``nbytes`` on every rank of ``group``.

    Construction and :meth:`close` are collective over ``group`` (same ``nbytes``, same
    order on every rank).

    Attributes:
        local: ``torch.uint8`` tensor ``[nbytes]`` on ``device``: this rank's block, zeroed
            on every rank before the constructor returns on any rank.
        peer_bases: ``torch.int64`` tensor ``[world]`` on ``device``: byte address of rank
            ``r``'s block as mapped in this process (``nvshmem_ptr``) for the ranks of this
            rank's node, 0 for the others; entry ``[rank]`` is ``local.data_ptr()``. Cast to a
            pointer in Triton with ``base.to(tl.pointer_type(dtype))``.
        net_bases: ``torch.int64`` tensor ``[world]`` on ``device``, every entry
            ``local.data_ptr()``: NVSHMEM's device calls name a peer's object by its local
            symmetric address and the peer's PE.
        rank, world: this rank and the group size (== NVSHMEM PE and PE count).

    After :meth:`close`, ``local`` and ``peer_bases`` are ``None`` and any view of the old
    tensors dangles.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        nbytes: int,
        device: torch.device | str | int,
        ranks_per_node: int,
        heap_bytes: int | None = None,
    ) -> None:
        """Collective. ``ranks_per_node``: nodes are that many consecutive ranks (heap.py's
        allocate_heap resolves its default), whose blocks must be reachable by load/store;
        other nodes' ranks get no peer mapping, even where one exists. ``heap_bytes`` only
        matters if this call initialises NVSHMEM (see :func:`ensure_initialized`); by default
        the heap then holds at least max(``nbytes``, 1 GiB) plus margin."""
        global _serial_counter
        group = _norm_group(group)
        device = _norm_device(device)
        nbytes = int(nbytes)
        if nbytes <= 0:
            raise ValueError(f"nbytes must be positive, got {nbytes}")
        if heap_bytes is None:
            heap_bytes = max(nbytes, _DEFAULT_HEAP_BYTES)
        ensure_initialized(group, device, heap_bytes=heap_bytes)
        import nvshmem.core as nvshmem

        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.device = device
        self._closed = False
        cdev = _comm_device(group, device)

        # nvshmem_malloc needs the same size on every PE (a mismatch aborts inside NVSHMEM):
        # check first, with a clear error on every rank.
        sizes = torch.tensor([nbytes, -nbytes], dtype=torch.int64, device=cdev)
        dist.all_reduce(sizes, op=dist.ReduceOp.MAX, group=group)
        if int(sizes[0]) != nbytes or int(sizes[1]) != -nbytes:
            raise ValueError(
                f"symmetric allocation sizes differ across ranks (rank {self.rank}: {nbytes} "
                f"B, range {-int(sizes[1])}..{int(sizes[0])} B)"
            )

        # Collective; NVSHMEM barriers on exit. Keep the tensor object nvshmem4py returned:
        # free_tensor looks the block up by this tensor's device and data_ptr.
        self._tensor = nvshmem.tensor((nbytes,), dtype=torch.uint8)
        self._tensor.zero_()  # nvshmem_malloc does not clear

        first = self.rank // ranks_per_node * ranks_per_node
        bases: list[int] = []
        errors: list[str] = []
        for pe in range(self.world):
            if not first <= pe < first + ranks_per_node:
                bases.append(0)
                continue
            if pe == self.rank:
                # Not get_peer_tensor on ourselves: nvshmem_ptr(self) is our own address,
                # and nvshmem4py would then bump the refcount of our own block, so that
                # free_tensor no longer frees it.
                bases.append(self._tensor.data_ptr())
                continue
            try:
                bases.append(nvshmem.get_peer_tensor(self._tensor, pe).data_ptr())
            except Exception as exc:  # NvshmemError: nvshmem_ptr returned NULL
                bases.append(0)
                errors.append(f"PE {pe}: {exc}")

        # Doubles as the barrier that keeps peers from storing into this block before our
        # zero_() above has run: the all_reduce is stream-ordered after it and everyone
        # waits for the result on the host.
        ok = torch.tensor([0 if errors else 1], dtype=torch.int32, device=cdev)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
        torch.cuda.synchronize(device)
        if int(ok.item()) == 0:
            # Every rank sees the failure, so the collective free below is matched.
            self._free()
            mine = "; ".join(errors) if errors else "this rank reaches all peers"
            raise RuntimeError(
                "NVSHMEM peer memory not reachable by load/store (nvshmem_ptr returned NULL) "
                f"on at least one rank; rank {self.rank}: {mine}. The ranks of a node "
                f"(ranks_per_node={ranks_per_node}) must have CUDA P2P/NVLink between their GPUs."
            )

        self.local = self._tensor
        self.peer_bases = torch.tensor(bases, dtype=torch.int64, device=device)
        self.net_bases = torch.full_like(self.peer_bases, self._tensor.data_ptr())
        self._serial = _serial_counter
        _serial_counter += 1
        _OPEN[self._serial] = self

    @property
    def nbytes(self) -> int:
        return 0 if self._closed else self._tensor.numel()

    def _free(self) -> None:
        import nvshmem.core as nvshmem

        self._closed = True
        tensor, self._tensor = self._tensor, None
        self.local = self.peer_bases = self.net_bases = None
        if _WORLD is not None:  # after finalize NVSHMEM has freed the block itself
            nvshmem.free_tensor(tensor)

    def close(self) -> None:
        """Free the block. Collective (NVSHMEM barriers inside ``nvshmem_free``); idempotent.

        Waits for this device's queued work first, so no kernel of ours still touches this
        block or a peer's; the barrier in ``nvshmem_free`` then covers the peers. Needs no
        ``torch.distributed``.
        """
        if self._closed:
            return
        _OPEN.pop(self._serial, None)
        if _WORLD is not None:
            torch.cuda.synchronize(self.device)
        self._free()

    def abandon(self) -> None:
        """Close without freeing, where a peer is gone (``nvshmem_free`` would wait for it):
        this block, every other one and NVSHMEM itself stay until the process ends, as
        ``finalize`` then does nothing. Local; idempotent."""
        global _ABANDONED
        _ABANDONED = True
        _OPEN.pop(self._serial, None)
        self._closed = True
        self._tensor = self.local = self.peer_bases = self.net_bases = None

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self.nbytes} B"
        return f"NvshmemAllocation(rank={self.rank}/{self.world}, {state}, {self.device})"


def init_module(compiled) -> None:
    """Initialise NVSHMEM's device state in a compiled Triton kernel's CUDA module (each module
    that calls NVSHMEM needs it once, before its first launch)."""
    import nvshmem.bindings

    nvshmem.bindings.cumodule_init(compiled.module)
