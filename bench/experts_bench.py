"""The experts' grouped GEMMs (``hybrid_ep_triton.experts.SwiGLUExperts``) on one GPU, world 1,
beside their floors and torch's grouped GEMM (or ``--device cpu``: tiny sizes on one CPU rank
under Triton's interpreter, a smoke test of the script).

Model (GPU): hidden 7168, 32 local experts (world 1: every expert on this rank), top-8, inner
size F = 2048 (DeepSeek-V3's expert). Two parts:

- decode, 128 tokens, the low-latency mode: the layer (``low_latency_dispatch`` -> experts into
  ``get_next_low_latency_combine_buffer`` -> ``low_latency_combine(zero_copy=True)``) and the
  experts alone on a dispatch's [L, C, H] blocks, in bf16 and in FP8 (use_fp8 rows, e4m3
  weights with 128x128 block scales); beside (a) the weight-read floor, the bytes of the
  weights of the experts that have rows over the HBM bandwidth that a large device-to-device
  copy reaches in the same run (bytes read and written over its time), and (b) the same MLP in
  bf16 with torch._grouped_mm on the same rows, with the copies it needs: the valid rows
  gathered from the blocks into one [T * K, H] tensor (a bound that needs no host read) and
  its output scattered back into the blocks (a per-expert loop where torch has no
  _grouped_mm; it reads the counts on the host first, outside the timed span);
- prefill, 4096 tokens, the normal mode: the experts on an exact-mode dispatch's expert-major
  rows, forward and forward + backward (dx, dW1, dW2), in TFLOP/s (forward 6 N H F FLOPs for N
  rows, backward twice that), beside torch._grouped_mm's forward and backward on the same rows.

Every path is first checked against torch's on the same rows (relative Frobenius error under
2e-2 in bf16, 8e-2 for FP8 against the bf16 weights they were quantized from). Times: CUDA
events around each call, issued back to back, the median of ``--iters`` calls after
``--warmup``, input sets rotated (tools/bench.py's median_us). Writes
<out>/<date>-<machine>-experts-<commit>.{json,md,png} (machine, date and commit inside).

Usage: python bench/experts_bench.py [--out DIR] [--device cuda|cpu] [--parts decode,prefill]
       [--warmup N] [--iters N]
"""

from __future__ import annotations

import argparse
import datetime
import os
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Model:
    decode_tokens: int
    prefill_tokens: int
    hidden: int
    experts: int
    topk: int
    ffn: int


MODELS = {
    "cuda": Model(decode_tokens=128, prefill_tokens=4096, hidden=7168, experts=32, topk=8,
                  ffn=2048),
    "cpu": Model(decode_tokens=4, prefill_tokens=8, hidden=128, experts=4, topk=2, ffn=128),
}  # fmt: skip
_SETS = 4  # input sets rotated through
_COPY_BYTES = 1 << 30  # the bandwidth probe's copy (GPU)
BF16_TOL, FP8_TOL = 2e-2, 8e-2


def _inputs(model: Model, tokens: int, seed: int, device):
    """x [T, H] bf16, topk_idx [T, K] (distinct experts), topk_weights [T, K] float32."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(tokens, model.hidden, device=device, generator=g).to(torch.bfloat16)
    scores = torch.rand(tokens, model.experts, device=device, generator=g)
    weights = torch.rand(tokens, model.topk, device=device, generator=g)
    return x, scores.topk(model.topk, dim=1).indices, weights


def _weights(model: Model, device):
    g = torch.Generator(device=device).manual_seed(1234)
    shape1 = (model.experts, 2 * model.ffn, model.hidden)
    shape2 = (model.experts, model.hidden, model.ffn)
    w1 = torch.randn(shape1, device=device, generator=g) / model.hidden**0.5
    w2 = torch.randn(shape2, device=device, generator=g) / model.ffn**0.5
    return w1.to(torch.bfloat16), w2.to(torch.bfloat16)


class TorchExperts:
    """The same SwiGLU experts in torch: torch._grouped_mm where torch has it on this device
    (CUDA), else a loop over experts, on expert-major rows [N, H] whose first sum(counts) rows
    are the experts' in order."""

    def __init__(self, w1: torch.Tensor, w2: torch.Tensor):
        self.ffn = w2.shape[2]
        # _grouped_mm's operand b is [L, K, N_out]: the weights transposed, laid out so (as
        # moe.MoELayer keeps its own), not timed.
        self.w1t = w1.detach().transpose(1, 2).contiguous().requires_grad_()
        self.w2t = w2.detach().transpose(1, 2).contiguous().requires_grad_()
        self.grouped = w1.is_cuda and hasattr(torch, "_grouped_mm")

    def __call__(self, rows: torch.Tensor, counts: torch.Tensor, host_counts: list[int]):
        if self.grouped:
            offs = counts.cumsum(0).to(torch.int32)
            h = torch._grouped_mm(rows, self.w1t, offs=offs)
            act = F.silu(h[:, : self.ffn]) * h[:, self.ffn :]
            return torch._grouped_mm(act, self.w2t, offs=offs)
        out, start = torch.zeros_like(rows), 0
        for e, n in enumerate(host_counts):
            h = rows[start : start + n] @ self.w1t[e]
            act = F.silu(h[:, : self.ffn]) * h[:, self.ffn :]
            out[start : start + n] = act @ self.w2t[e]
            start += n
        return out


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30)).item()


# -- decode ------------------------------------------------------------------------------------


def _compacted(recv_x: torch.Tensor, recv_count: torch.Tensor, bound: int):
    """The valid rows of [L, C, H] blocks first, expert by expert: (their flat positions,
    ``bound`` of them, with no host read; the rows gathered)."""
    num_experts, capacity, hidden = recv_x.shape
    valid = torch.arange(capacity, device=recv_x.device) < recv_count[:, None]
    order = torch.argsort((~valid).flatten().to(torch.int8), stable=True)[:bound]
    return order, recv_x.reshape(-1, hidden)[order]


def _rows_as_bf16(recv_x) -> torch.Tensor:
    """A low-latency dispatch's rows [L, C, H] in bf16 (an FP8 pair dequantized)."""
    if not isinstance(recv_x, tuple):
        return recv_x
    values, scales = recv_x
    blocks = values.float().unflatten(-1, (-1, 128)) * scales[..., None]
    return blocks.flatten(-2).to(torch.bfloat16)


def _decode(buf, model: Model, experts: dict, baseline: TorchExperts, sets, opts) -> list:
    """Rows of the decode part, and its check failures in ``errors`` (see the module)."""
    from hybrid_ep_triton.tools.bench import median_us

    tokens, hidden = model.decode_tokens, model.hidden
    bound = tokens * model.topk
    rows, errors = [], []
    for fmt, mlp in experts.items():
        fp8 = fmt == "fp8"
        dispatched = []
        for x, idx, _ in sets:
            recv_x, recv_count, *_ = buf.low_latency_dispatch(x, idx, tokens, model.experts,
                                                              use_fp8=fp8)  # fmt: skip
            dispatched.append((recv_x, recv_count, recv_count.tolist()))
        out = torch.empty(model.experts, tokens, hidden, dtype=torch.bfloat16, device=x.device)

        def experts_only(recv_x, recv_count, host_counts, mlp=mlp, out=out):
            return mlp.low_latency(recv_x, recv_count, out=out)

        def layer(x, idx, weights, fp8=fp8, mlp=mlp):
            recv_x, recv_count, handle, _, _ = buf.low_latency_dispatch(
                x, idx, tokens, model.experts, use_fp8=fp8
            )
            combine_buffer = buf.get_next_low_latency_combine_buffer(handle)
            mlp.low_latency(recv_x, recv_count, out=combine_buffer)
            return buf.low_latency_combine(combine_buffer, idx, weights, handle, zero_copy=True)

        recv_x, recv_count, host_counts = dispatched[0]
        valid = sum(host_counts)
        order, compact = _compacted(_rows_as_bf16(recv_x), recv_count, bound)
        want = baseline(compact, recv_count, host_counts)[:valid]
        got = experts_only(*dispatched[0]).reshape(-1, hidden)[order][:valid]
        error = _relative_error(got, want)
        if not error < (FP8_TOL if fp8 else BF16_TOL):
            errors.append(f"decode {fmt}: experts off torch's by {error:.3g}")
        active = sum(1 for n in host_counts if n)
        weight_bytes = active * sum(w.nbytes for w in mlp.state_dict().values()) // model.experts
        timed = {"layer": (layer, sets), "experts": (experts_only, dispatched)}
        if not fp8:

            def torch_experts(recv_x, recv_count, host_counts, out=out):
                order, compact = _compacted(recv_x, recv_count, bound)
                out.view(-1, hidden)[order] = baseline(compact, recv_count, host_counts)
                return out

            timed["torch grouped_mm + copies"] = (torch_experts, dispatched)
        for what, (fn, arguments) in timed.items():
            with torch.no_grad():
                us, _ = median_us(fn, arguments, opts["warmup"], opts["iters"])
            rows.append(dict(part="decode", format=fmt, what=what, us=us,
                             weight_bytes=weight_bytes, error=error))  # fmt: skip
    return rows, errors


# -- prefill -----------------------------------------------------------------------------------


def _prefill(buf, model: Model, mlp, baseline: TorchExperts, sets, opts) -> tuple:
    from hybrid_ep_triton.tools.bench import median_us

    dispatched = []
    for x, idx, weights in sets:
        recv_x, _, tokens_per_expert, _ = buf.dispatch(x, idx, weights)
        dispatched.append((recv_x, tokens_per_expert, tokens_per_expert.tolist(),
                           torch.randn_like(recv_x)))  # fmt: skip
    recv_x, tokens_per_expert, host_counts, dy = dispatched[0]
    errors = []
    with torch.no_grad():
        error = _relative_error(mlp(recv_x, tokens_per_expert),
                                baseline(recv_x, tokens_per_expert, host_counts))  # fmt: skip
    if not error < BF16_TOL:
        errors.append(f"prefill: experts off torch's by {error:.3g}")
    num_rows = sum(host_counts)
    flops = 6 * num_rows * model.hidden * model.ffn

    def ours_forward(rows, counts, host, dy):
        with torch.no_grad():
            return mlp(rows, counts)

    def ours_backward(rows, counts, host, dy):
        rows = rows.detach().requires_grad_()
        return torch.autograd.grad(mlp(rows, counts), [rows, mlp.w1, mlp.w2], dy)

    def torch_forward(rows, counts, host, dy):
        with torch.no_grad():
            return baseline(rows, counts, host)

    def torch_backward(rows, counts, host, dy):
        rows = rows.detach().requires_grad_()
        y = baseline(rows, counts, host)
        return torch.autograd.grad(y, [rows, baseline.w1t, baseline.w2t], dy)

    timed = {
        ("experts", "forward"): ours_forward,
        ("experts", "forward + backward"): ours_backward,
        ("torch grouped_mm", "forward"): torch_forward,
        ("torch grouped_mm", "forward + backward"): torch_backward,
    }
    rows = []
    for (what, direction), fn in timed.items():
        us, _ = median_us(fn, dispatched, opts["warmup"], opts["iters"])
        work = flops * (3 if direction != "forward" else 1)
        rows.append(dict(part="prefill", format="bf16", what=f"{what} {direction}", us=us,
                         tflops=work / us / 1e6, rows=num_rows, error=error))  # fmt: skip
    return rows, errors


# -- one rank ----------------------------------------------------------------------------------


def _copy_gbps(device, opts) -> float | None:
    """HBM bandwidth (bytes read and written over a device-to-device copy's time), or None on
    the CPU."""
    if device.type != "cuda":
        return None
    from hybrid_ep_triton.tools.bench import median_us

    src = torch.empty(_COPY_BYTES, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    us, _ = median_us(dst.copy_, [(src,)], opts["warmup"], opts["iters"])
    return 2 * _COPY_BYTES / us / 1e3


def _rank(rank: int, world: int, opts: dict) -> dict:
    from hybrid_ep_triton import Buffer
    from hybrid_ep_triton.experts import SwiGLUExperts, quantize_weights_fp8
    from hybrid_ep_triton.tools.launcher import rank_device

    device = rank_device()
    model = MODELS[device.type]
    w1, w2 = _weights(model, device)
    (q1, s1), (q2, s2) = quantize_weights_fp8(w1), quantize_weights_fp8(w2)
    experts = {"bf16": SwiGLUExperts(w1, w2), "fp8": SwiGLUExperts(q1, q2, s1, s2)}
    baseline = TorchExperts(w1, w2)
    result = dict(rows=[], errors=[], copy_GBps=_copy_gbps(device, opts), model=asdict(model))
    buf = Buffer(None, hidden_size=model.hidden, max_tokens_per_rank=model.prefill_tokens,
                 num_experts=model.experts, low_latency_tokens=model.decode_tokens,
                 device=device)  # fmt: skip
    try:
        if "decode" in opts["parts"]:
            sets = [_inputs(model, model.decode_tokens, s, device) for s in range(_SETS)]
            rows, errors = _decode(buf, model, experts, baseline, sets, opts)
            result["rows"] += rows
            result["errors"] += errors
        if "prefill" in opts["parts"]:
            sets = [_inputs(model, model.prefill_tokens, s, device) for s in range(_SETS)]
            rows, errors = _prefill(buf, model, experts["bf16"], baseline, sets, opts)
            result["rows"] += rows
            result["errors"] += errors
    finally:
        buf.destroy()
    if result["copy_GBps"]:
        for row in result["rows"]:
            if "weight_bytes" in row:
                row["floor_us"] = row["weight_bytes"] / result["copy_GBps"] / 1e3
    return result


# -- report ------------------------------------------------------------------------------------


def _cell(value, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _markdown(result: dict) -> list[str]:
    model = result["model"]
    lines = [
        f"# Experts' grouped GEMMs, world 1: {result['machine']}",
        "",
        f"date {result['date']}, commit {result['commit']}; hidden {model['hidden']}, "
        f"{model['experts']} local experts, top-{model['topk']}, F {model['ffn']}; decode "
        f"{model['decode_tokens']} tokens (low-latency), prefill {model['prefill_tokens']} "
        f"tokens (normal mode); {result['iters']} calls after {result['warmup']}, medians. "
        f"HBM bandwidth of a device copy (read + written): {_cell(result['copy_GBps'], 0)} "
        "GB/s; floor: the weights of the experts with rows over it.",
        "",
        "| part | format | what | µs | floor µs | µs / floor | TFLOP/s |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        floor = r.get("floor_us")
        ratio = r["us"] / floor if floor else None
        lines.append(
            f"| {r['part']} | {r['format']} | {r['what']} | {_cell(r['us'])} | "
            f"{_cell(floor)} | {_cell(ratio, 2)} | {_cell(r.get('tflops'), 0)} |"
        )
    return lines


def _plot(result: dict, path: str) -> None:
    """Decode: µs of each path beside its floor; prefill: TFLOP/s of each path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    decode = [r for r in result["rows"] if r["part"] == "decode"]
    labels = [f"{r['format']} {r['what']}" for r in decode]
    axes[0].barh(labels, [r["us"] for r in decode], label="measured")
    floors = [r.get("floor_us") or 0 for r in decode]
    axes[0].barh(labels, floors, height=0.3, color="k", label="weight-read floor")
    axes[0].set_xlabel("µs")
    axes[0].set_title("decode (low-latency), world 1", fontsize=9)
    axes[0].legend(fontsize=7)
    prefill = [r for r in result["rows"] if r["part"] == "prefill"]
    axes[1].barh([r["what"] for r in prefill], [r["tflops"] for r in prefill])
    axes[1].set_xlabel("TFLOP/s")
    axes[1].set_title("prefill (normal mode), bf16", fontsize=9)
    fig.suptitle(f"{result['machine']}, {result['commit']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _arguments() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench/results")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="default: cuda where torch sees a GPU")  # fmt: skip
    p.add_argument("--parts", default="decode,prefill")
    p.add_argument("--warmup", type=int, default=None, help="default 10 (CPU: 1)")
    p.add_argument("--iters", type=int, default=None, help="default 50 (CPU: 2)")
    args = p.parse_args()
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    on_cpu = args.device == "cpu"
    args.warmup = args.warmup if args.warmup is not None else (1 if on_cpu else 10)
    args.iters = args.iters if args.iters is not None else (2 if on_cpu else 50)
    unknown = set(args.parts.split(",")) - {"decode", "prefill"}
    if unknown:
        p.error(f"unknown parts {sorted(unknown)}")
    return args


def main() -> int:
    args = _arguments()
    from hybrid_ep_triton.tools.bench import commit, write_report
    from hybrid_ep_triton.tools.launcher import run_ranks

    opts = dict(parts=args.parts.split(","), warmup=args.warmup, iters=args.iters)
    (found,) = run_ranks(_rank, 1, opts, device=args.device, timeout_s=1800)
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    result = dict(machine=f"1x {name}",
                  machine_slug=f"1x{name.replace('NVIDIA ', '').replace(' ', '')}",
                  date=datetime.date.today().isoformat(), commit=commit(), **opts,
                  **found)  # fmt: skip
    stem = write_report(args.out, f"experts-{result['commit']}", _markdown(result), result, _plot)
    with open(stem + ".md") as f:
        print(f.read())
    print(f"written: {os.path.basename(stem)}.{{json,md,png}}")
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
