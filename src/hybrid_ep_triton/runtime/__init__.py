"""Where memory and plans come from: the symmetric heap (NVSHMEM on GPUs, POSIX shared memory on
CPU ranks), node topology, the planner of channels, chunks and heap regions, the tuning cache
and where it lives, the argument checks, the check of the CUDA packages of GPU ranks, and
NVSHMEM's device library trimmed for the kernels across nodes."""
