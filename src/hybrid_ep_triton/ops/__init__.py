"""Torch-facing operations: they launch the kernels for a Buffer's runtime state (runtime.py).

runtime: the Runtime and its making; geometry: programs and constexprs of a launch; launch:
kernel launches that cost little host time; handle: DispatchHandle; dispatch and combine: the
normal mode's launches; low_latency: the low-latency mode's; quantize: the quantizers alone;
scaled_rows: ScaledValues; status: what the device recorded, as exceptions; refusal: the
protocol by which a rank's refused inputs reach every rank; streams: calls on the Buffer's
communication stream; operators: the torch.library operators and their autograd; masks: the mask
of failed ranks and destroy()'s farewell; reserved: a heap reserved before a Buffer's sizes are
known, which a Buffer made later takes without a collective; token_counts: what a dispatch
would send where, on one rank (Buffer.token_counts); experts: the experts' grouped GEMMs
(SwiGLUExperts') and their workspace.
"""

from ..runtime import triton_compat

triton_compat.apply()
