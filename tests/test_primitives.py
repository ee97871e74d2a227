"""Device primitives that need no peer: the work-queue order of ``interleaved``, and the wait
for a record the host writes (``wait_host_record``); and a loop over an integer argument, which
the kernels take on every Triton and NumPy they support (kernels/__init__.py), and an address
passed as an integer (``host_pointer``)."""

import pytest
import torch
import triton
import triton.language as tl

from hybrid_ep_triton.kernels.control import STATUS_TIMED_OUT
from hybrid_ep_triton.kernels.primitives import (
    HOST_RECORD_VALUES,
    HOST_RECORD_WORDS,
    host_pointer,
    interleaved,
    wait_host_record,
)
from hybrid_ep_triton.ops.dispatch import write_host_record

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


@triton.jit
def _host_record_kernel(record_addr, tag, timeout_ns, status_ptr, out_ptr):
    words = wait_host_record(
        record_addr.to(tl.pointer_type(tl.int64)), tag, timeout_ns, status_ptr, 7, 9
    )
    tl.store(out_ptr + tl.arange(0, HOST_RECORD_WORDS), words)


@pytest.mark.parametrize("record", ["complete", "another tag", "torn"])
def test_wait_host_record_takes_only_a_complete_record_of_its_tag(device, record):
    """A record written by write_host_record under the awaited tag is returned at once; one of
    another tag, or whose check does not add up (words of two writes), times out recording
    (TIMED_OUT, peer, stage)."""
    gen = torch.Generator().manual_seed(len(record))
    values = tuple(torch.randint(0, 2**48, (int(HOST_RECORD_VALUES),), generator=gen).tolist())
    words = torch.zeros(HOST_RECORD_WORDS, dtype=torch.int64, pin_memory=device == "cuda")
    write_host_record(words.numpy(), 41 if record == "another tag" else 43, values)
    if record == "torn":
        words[3] += 1  # one value of a later record beside the check of an earlier one
    status = torch.zeros(3, dtype=torch.int64, device=device)
    out = torch.zeros(HOST_RECORD_WORDS, dtype=torch.int64, device=device)
    _host_record_kernel[(1,)](words.data_ptr(), 43, 2_000_000, status, out)
    if record == "complete":
        assert status.tolist() == [0, 0, 0]
        assert out.tolist() == words.tolist() and out[1 : 1 + len(values)].tolist() == list(values)
    else:
        assert status.tolist() == [int(STATUS_TIMED_OUT), 7, 9]


@triton.jit
def _tile_sums_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    # range() over an integer argument: under the interpreter of Triton 3.6 with NumPy 2.4 and
    # later it raised unless the kernels' package (imported above) made such scalars indexes.
    total = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        total += tl.load(x_ptr + cols, mask=cols < n, other=0.0)
    tl.store(out_ptr, tl.sum(total, axis=0))


@pytest.mark.parametrize("n", [1, 7, BLOCK, 3 * BLOCK + 5])
def test_a_loop_over_an_integer_argument(device, n):
    x = torch.randn(n, device=device)
    out = torch.zeros(1, device=device)
    _tile_sums_kernel[(1,)](x, out, n, BLOCK=BLOCK)
    torch.testing.assert_close(out[0].cpu(), x.sum().cpu(), rtol=1e-5, atol=1e-5)


@triton.jit
def _host_pointer_kernel(address, out_ptr):
    tl.store(out_ptr, host_pointer(address, tl.int64).to(tl.int64))


# Triton types an integer argument int32 below 2**31, int64 above; its interpreter holds one
# below 2**32 in 4 bytes.
@pytest.mark.parametrize("address", [0x1000, 2**31 + 0x1000, 2**40 + 0x1000])
def test_host_pointer_keeps_any_address(device, address):
    out = torch.zeros(1, dtype=torch.int64, device=device)
    _host_pointer_kernel[(1,)](address, out)
    assert out.item() == address
