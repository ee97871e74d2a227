"""Names of the words a Buffer's launches share with each other and with the host.

The control block is int64 [CONTROL_WORDS] in device memory, one per Buffer; the report is
int64 [REPORT_EXPERTS + L] in the host's pinned memory, written by an exact-mode layout launch; a
wait that times out records its stage code. Kernels, ops and Buffer name them from here: they
are tl.constexpr, so the kernels compile them as the literals they stand for, and the host
reads them as int(NAME).
"""

import triton.language as tl

# -- the control block ---------------------------------------------------------------------
DATA_SEQ = tl.constexpr(0)  # sequence number of the last finished data launch (dispatch, combine)
DATA_TICKET = tl.constexpr(1)  # tickets of the running data launch's programs (finish_launch)
LAYOUT_SEQ = tl.constexpr(2)  # sequence number of the last layout exchange
STATUS = tl.constexpr(3)  # STATUS_WORDS: a timed-out wait's code, peer and stage, at
STATUS_WORDS = tl.constexpr(3)  # these offsets from STATUS:
STATUS_CODE = tl.constexpr(0)  # 0 while no wait has timed out, then STATUS_TIMED_OUT
STATUS_PEER = tl.constexpr(1)
STATUS_STAGE = tl.constexpr(2)
# Work queues of a data launch's local roles, reset by its last program: [6] dispatch's
# expanders and combine's reducers, [7] dispatch's quantizers and combine's finishers.
FIRST_QUEUE = tl.constexpr(6)
SECOND_QUEUE = tl.constexpr(7)
LAYOUT_TICKET = tl.constexpr(8)  # tickets of the running layout launch's programs
BAD_ROW = tl.constexpr(9)  # the launch's first invalid row, as kernels/route.py encodes it
NET_ROWS = tl.constexpr(10)  # token rows this rank has put over the network in dispatches
# The host record of the running exact-mode data move (HOST_RECORD_VALUES words: N and the
# outputs' addresses), copied there by one program for the others, and the launch's sequence
# number once it is (ops/dispatch.PreparedMove).
HOST_RECORD = tl.constexpr(11)
HOST_RECORD_SEQ = tl.constexpr(17)
# The low-latency mode (kernels/low_latency.py): the sequence number of its last call (dispatch
# and combine count together: a call's receive area is the parity of its number), the tickets
# a sending launch's programs take as they start, and the first rank that refused a call + 1
# (another rank, whose host refused the call's inputs or whose dispatch's topk_idx held an
# expert id outside [-1, E); or this one, for such a topk_idx: its host raises the others).
LL_SEQ = tl.constexpr(18)
LL_TICKET = tl.constexpr(19)
LL_REFUSED = tl.constexpr(20)
# A low-latency dispatch's layout_range entry for a source that refused the call: no rows, and
# a combine along the handle sends that source its flags all the same (with no rows), since its
# topk_idx names experts it sent no rows to, whose flags its combine waits for.
LL_REFUSED_RANGE = tl.constexpr(-1)
# Any other layout_range entry, as DeepEP packs it: (first row << LL_RANGE_SHIFT) | rows.
LL_RANGE_SHIFT = tl.constexpr(32)
LL_RANGE_ROWS = tl.constexpr((1 << LL_RANGE_SHIFT.value) - 1)
# A low-latency flag is (seq << LL_SEQ_SHIFT) | a rows field: the rows of a block (at most the
# Buffer's low_latency_tokens, which it keeps within LL_MAX_ROWS), and the bit above them where
# the source's host refused the call. A flag then holds 46 bits of seq: a Buffer may make 2^46
# calls (17 years of 8 us calls back to back) before a flag would wrap.
LL_SEQ_SHIFT = tl.constexpr(17)
LL_MAX_ROWS = tl.constexpr((1 << (LL_SEQ_SHIFT.value - 1)) - 1)
# Masked ranks (the mask itself is the heap's mask region, which peers write into): 1 where the
# Buffer masks a rank that a wait ran out on (mask_failed_ranks), else 0 (the wait records a
# timeout).
MASK_FAILED = tl.constexpr(21)
# The tickets a receiving launch's programs take as they end (its last one frees the receive
# area), and 1 where this rank masked a rank (by hand, or a wait that ran out) that the next
# launch tells the others of.
LL_DONE = tl.constexpr(22)
MASKS_NEW = tl.constexpr(23)
CONTROL_WORDS = 24

STATUS_OK = tl.constexpr(0)
STATUS_TIMED_OUT = tl.constexpr(1)

# -- the report of an exact-mode layout (host memory) --------------------------------------
REPORT_TAG = tl.constexpr(0)  # written last: the report of the launch given this tag
REPORT_ROWS = tl.constexpr(1)  # rows the output needs
REPORT_SOURCE = tl.constexpr(2)  # first rank whose dispatch could not go ahead, or -1
REPORT_BAD_ROW = tl.constexpr(3)  # first invalid row of this rank (as the handle's info[2])
REPORT_STATUS = tl.constexpr(4)  # STATUS_WORDS: the control block's status
REPORT_CAUSE = tl.constexpr(7)  # why REPORT_SOURCE's could not (ops/handle.REFUSABLE)
REPORT_EXPERTS = tl.constexpr(8)  # L words from here: tokens_per_expert (the report's last)

# -- a dispatch handle's info: int64 [INFO_WORDS], where the handle's state starts ---------
INFO_ROWS = tl.constexpr(0)  # rows the output needs (also past max_recv_tokens)
INFO_SOURCE = tl.constexpr(1)  # first rank whose dispatch could not go ahead, or -1
INFO_BAD_ROW = tl.constexpr(2)  # 2**62 - (first invalid row of this rank's topk_idx), or 2**62
INFO_CAUSE = tl.constexpr(3)  # why INFO_SOURCE's could not (ops/handle.REFUSABLE)
INFO_WORDS = 4

# -- what a token row's metadata entry holds (dispatch with TOKEN_ROWS) ------------------
# Entry i of a staged token row: (slot << SLOT_SHIFT) | local expert id of the token's i-th
# slot on the destination, so that the receiver puts each id and weight back at its slot;
# after the entries, the source token's index.
SLOT_SHIFT = tl.constexpr(16)
LOCAL_ID_MASK = tl.constexpr((1 << SLOT_SHIFT.value) - 1)

# -- stage codes: what a timed-out wait was waiting for ------------------------------------
STAGE_LAYOUT = tl.constexpr(1)  # the layout exchange
STAGE_DISPATCH_READY = tl.constexpr(2)  # the start of a peer's dispatch
STAGE_DISPATCH_DATA = tl.constexpr(3)  # dispatch token chunks
STAGE_COMBINE_READY = tl.constexpr(4)  # the start of a peer's combine
STAGE_COMBINE_DATA = tl.constexpr(5)  # combine partial sums
STAGE_DISPATCH_NET = tl.constexpr(6)  # dispatch token chunks over the network
STAGE_COMBINE_NET = tl.constexpr(7)  # combine partial sums over the network
STAGE_DISPATCH_QUANTIZED = tl.constexpr(8)  # dispatch's quantization of this rank's rows
STAGE_DISPATCH_OUTPUTS = tl.constexpr(9)  # the host's outputs of an exact-mode dispatch
STAGE_LL_DISPATCH = tl.constexpr(10)  # low-latency dispatch rows from a source
STAGE_LL_COMBINE = tl.constexpr(11)  # low-latency combine rows from an expert's rank
STAGE_LL_FREED = tl.constexpr(12)  # the receive of a destination's call two calls back
