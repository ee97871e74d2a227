"""DeepEP's ``Config``, its size hints and recommended configurations (its formulas and tables,
deep_ep/buffers/legacy.py and csrc/kernels/legacy): the calls accept a Config and ignore it;
clients size DeepEP buffers with the hints, and ``num_rdma_bytes`` sizes the low-latency area
(``get_low_latency_rdma_size_hint``: the planner's copy of DeepEP's formula)."""

from __future__ import annotations

from ..runtime.checks import MAX_LOW_LATENCY_TOKENS
from ..runtime.planner import deepep_low_latency_bytes as get_low_latency_rdma_size_hint

# DeepEP's constants behind its size hints (csrc/kernels/legacy/compiled.cuh, internode.cu).
NVL_PEERS = 8
ALIGNMENT = 128
SOURCE_META_BYTES = 8
MAX_TOPK_HINT = 128
MAX_SCALES_HINT = 128
# DeepEP's recommended (dispatch, combine) configurations by group size, each as
# (nvl send, nvl recv, rdma send, rdma recv) tokens.
RECOMMENDED = {
    2: ((24, 256, 6, 128), (10, 256, 6, 128)),
    4: ((6, 256, 6, 128), (9, 256, 6, 128)),
    8: ((6, 256, 6, 128), (4, 256, 6, 128)),
    16: ((36, 288, 20, 128), (4, 288, 12, 128)),
    24: ((32, 288, 8, 128), (1, 288, 8, 128)),
    32: ((32, 288, 8, 128), (1, 288, 8, 128)),
    48: ((32, 288, 8, 128), (1, 288, 8, 128)),
    64: ((32, 288, 8, 128), (1, 288, 8, 128)),
    96: ((20, 480, 12, 128), (1, 480, 8, 128)),
    128: ((20, 560, 12, 128), (1, 560, 8, 128)),
    144: ((32, 720, 12, 128), (2, 720, 8, 128)),
    160: ((28, 720, 12, 128), (2, 720, 8, 128)),
}


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class Config:
    """DeepEP's performance configuration of a normal-mode call.

    Accepted and ignored by the calls (this library's kernels take their parameters from its
    tuning cache); the size hints are DeepEP's, for clients that size DeepEP buffers with them.

    Args:
        num_sms: SMs of DeepEP's kernels (even: the calls refuse an odd count, as DeepEP's).
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
        rdma_ranks = max(num_ranks // NVL_PEERS, 1)
        slots = self.num_sms // 2 * min(num_ranks, NVL_PEERS)
        tokens = slots * self.num_max_nvl_chunked_recv_tokens
        per_token = hidden_bytes + SOURCE_META_BYTES + MAX_TOPK_HINT * (8 + 4) + MAX_SCALES_HINT * 4
        return round_up(slots * (2 * rdma_ranks + 3) * 4 + tokens * per_token, ALIGNMENT)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """DeepEP's RDMA buffer bytes (0 within one node of at most 8 ranks)."""
        if num_ranks <= NVL_PEERS:
            return 0
        slots = self.num_sms // 2 * (num_ranks // NVL_PEERS)
        tokens = slots * self.num_max_rdma_chunked_recv_tokens
        per_token = hidden_bytes + SOURCE_META_BYTES + MAX_TOPK_HINT * (8 + 4)
        per_token += MAX_SCALES_HINT * 4 + 16
        return round_up(slots * (NVL_PEERS * 2 + 2) * 2 * 4 + tokens * per_token * 2, ALIGNMENT)

    def __repr__(self) -> str:
        nvl = self.num_max_nvl_chunked_send_tokens, self.num_max_nvl_chunked_recv_tokens
        rdma = self.num_max_rdma_chunked_send_tokens, self.num_max_rdma_chunked_recv_tokens
        return f"Config(num_sms={self.num_sms}, nvl chunks {nvl}, rdma chunks {rdma})"


def recommended(num_sms: int, num_ranks: int, combine: bool) -> Config:
    """DeepEP's recommended dispatch (or ``combine``) Config for ``num_ranks`` (ValueError for
    a group size DeepEP has none for, as it asserts)."""
    if num_ranks not in RECOMMENDED:
        raise ValueError(f"Unsupported number of EP ranks: {num_ranks}")
    return Config(num_sms, *RECOMMENDED[num_ranks][combine])


def tokens_that_fit(num_rdma_bytes: int, hidden: int, num_ranks: int, num_experts: int) -> int:
    """The most tokens M whose DeepEP size hint is at most ``num_rdma_bytes`` (0: none), at most
    what the low-latency mode takes (MAX_LOW_LATENCY_TOKENS)."""
    hint = lambda tokens: get_low_latency_rdma_size_hint(tokens, hidden, num_ranks, num_experts)
    low, high = 0, 1
    while hint(high) <= num_rdma_bytes:
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if hint(middle) <= num_rdma_bytes else (low, middle)
    return min(low, MAX_LOW_LATENCY_TOKENS)
