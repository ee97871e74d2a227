"""Device primitives that need no peer: the work-queue order of ``interleaved``."""

import pytest
import torch
import triton
import triton.language as tl

from hybrid_ep_triton.kernels.primitives import interleaved

BLOCK = 256


@triton.jit
def _queue_order_kernel(is_a_ptr, index_ptr, count_a, count_b, BLOCK: tl.constexpr):
    entries = tl.arange(0, BLOCK)
    mask = entries < count_a + count_b
    is_a, index = interleaved(entries, count_a, count_b)
    tl.store(is_a_ptr + entries, is_a.to(tl.int32), mask=mask)
    tl.store(index_ptr + entries, index, mask=mask)


@pytest.mark.parametrize(
    "count_a, count_b",
    [(1, 0), (0, 1), (1, 1), (5, 5), (128, 128), (3, 17), (17, 3), (1, 200), (200, 1), (97, 131)],
)
def test_interleaved_spreads_two_kinds_evenly(device, count_a, count_b):
    total = count_a + count_b
    is_a = torch.full((BLOCK,), -1, dtype=torch.int32, device=device)
    index = torch.full((BLOCK,), -1, dtype=torch.int32, device=device)
    _queue_order_kernel[(1,)](is_a, index, count_a, count_b, BLOCK=BLOCK)
    is_a, index = is_a[:total].cpu().bool(), index[:total].cpu()
    # Each kind comes whole and in its own order.
    assert index[is_a].tolist() == list(range(count_a))
    assert index[~is_a].tolist() == list(range(count_b))
    if count_a:
        assert is_a[0]
    # Evenly: after any n entries, the A items taken are within one of n * count_a / total.
    a_taken = torch.cumsum(is_a.to(torch.int64), 0)
    expected = torch.arange(1, total + 1, dtype=torch.float64) * count_a / total
    assert (a_taken - expected).abs().max() < 1
