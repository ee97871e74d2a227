"""The CUDA MPS control daemon, for ranks that share a GPU.

Without MPS, processes on one GPU are time-sliced: a flag round trip between two ranks takes
milliseconds (4.5 ms on an H200), so the ranks' kernels wait on each other for most of their
time. Under MPS they run at the same time, each on its share of the SMs (2.3-2.7 µs per round
trip there). A process connects to the daemon when CUDA starts in it, through the pipe directory
``CUDA_MPS_PIPE_DIRECTORY`` (default /tmp/nvidia-mps); under
``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=p`` its context reports and uses p% of the SMs, rounded down
to an even count (on an H200: 66, 32 and 14 of its 132 SMs at 50, 25 and 12%). One daemon serves
every process of the machine: run one test session on it at a time (a restart after a killed
rank ends the others' clients).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

CONTROL = "nvidia-cuda-mps-control"
_DEFAULT_PIPE_DIRECTORY = "/tmp/nvidia-mps"
_DEFAULT_LOG_DIRECTORY = "/var/log/nvidia-mps"
_ANSWER_TIMEOUT_S = 10.0
_QUIT_TIMEOUT_S = 30.0

START = (
    "mkdir -p /tmp/mps /tmp/mpslog && export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps "
    f"CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog && setsid {CONTROL} -d"
)
STOP = f"echo quit | {CONTROL}"
HOW_TO = (
    f"start the MPS control daemon first: `{START}` (the same two variables in the shell that "
    f"starts the ranks), and stop it afterwards with `{STOP}`; never change the GPU's compute "
    "mode for it"
)


def thread_percentage(ranks_per_gpu: int) -> int:
    """Each rank's CUDA_MPS_ACTIVE_THREAD_PERCENTAGE when ``ranks_per_gpu`` ranks share a GPU:
    the shares sum to at most 100, as NVSHMEM wants for several PEs on one GPU."""
    return 100 // ranks_per_gpu


def daemon_answers() -> bool:
    """Whether an MPS control daemon answers on this process's pipe directory (a query that
    returns at once either way: 'Cannot find MPS control daemon process' when there is none)."""
    if shutil.which(CONTROL) is None:
        return False
    try:
        done = subprocess.run(
            [CONTROL],
            input="get_server_list\n",
            capture_output=True,
            text=True,
            timeout=_ANSWER_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def restart_daemon() -> None:
    """Quit the control daemon and start a new one with the same directories; call this once no
    rank of ours is left. After a client was killed while MPS held its context, the server can
    refuse new clients (Error 807, 'MPS server is not ready to accept new MPS client
    requests'); a new daemon starts a new server. RuntimeError, with the commands to do it by
    hand, where the daemon does not quit in time (it waits for its clients to end)."""
    print(
        "hybrid_ep_triton: a rank sharing a GPU was killed while MPS held its context; "
        "restarting the MPS control daemon before the next ranks start",
        file=sys.stderr,
        flush=True,
    )
    try:
        subprocess.run(
            [CONTROL],
            input="quit\n",
            text=True,
            capture_output=True,
            timeout=_QUIT_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise RuntimeError(
            f"the MPS control daemon did not quit within {_QUIT_TIMEOUT_S:g} s (clients of it "
            f"are still running): end them, then `{STOP}` and `{START}`"
        ) from None
    for variable, default in (
        ("CUDA_MPS_PIPE_DIRECTORY", _DEFAULT_PIPE_DIRECTORY),
        ("CUDA_MPS_LOG_DIRECTORY", _DEFAULT_LOG_DIRECTORY),
    ):
        os.makedirs(os.environ.get(variable, default), exist_ok=True)
    subprocess.run([CONTROL, "-d"], start_new_session=True, check=True, timeout=_QUIT_TIMEOUT_S)
