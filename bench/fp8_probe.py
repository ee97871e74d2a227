"""Where an FP8 dispatch differs from the reference on one GPU (a diagnostic, one rank):

    python3 bench/fp8_probe.py

For expert-major and token rows at 4096 and fewer tokens (hidden 7168, top-8 of 256 experts),
quantize=True against the reference quantizer run on the CPU, then reference.dispatch of values
(as bytes) and scales: counts of differing rows and columns of values and scales.
"""

import torch

import hybrid_ep_triton as hep
from hybrid_ep_triton import reference
from hybrid_ep_triton.tools.launcher import run_ranks


def _rank(rank: int, world: int) -> list[str]:
    lines = []
    for tokens, topk in ((4096, 8), (512, 8), (64, 8), (4096, 2)):
        g = torch.Generator(device="cuda").manual_seed(tokens + topk)
        x = torch.randn(tokens, 7168, device="cuda", generator=g).to(torch.bfloat16)
        idx = torch.rand(tokens, 256, device="cuda", generator=g).topk(topk, dim=1).indices
        w = torch.rand(tokens, topk, device="cuda", generator=g)
        values, scales = (t.cuda() for t in reference.quantize_fp8(x.cpu()))
        for expand in (True, False):
            buf = hep.Buffer(None, hidden_size=7168, max_tokens_per_rank=tokens,
                             num_experts=256, num_sms=8, expand=expand)  # fmt: skip
            kw = dict(num_experts=256, expand=expand)
            ref_v = reference.dispatch(None, values.view(torch.uint8), idx, w, **kw)[0]
            ref_s = reference.dispatch(None, scales, idx, w, **kw)[0]
            for how in ("quantize", "pair"):
                if how == "quantize":
                    (v, s), *_ = buf.dispatch(x, idx, w, quantize=True)
                else:
                    (v, s), *_ = buf.dispatch((values, scales), idx, w)
                bad_v = v.view(torch.uint8) != ref_v
                bad_s = s != ref_s
                lines.append(
                    f"T={tokens} K={topk} expand={expand} {how}: rows {ref_v.shape[0]}, values "
                    f"differ in {int(bad_v.any(1).sum())} rows / cols "
                    f"{bad_v.any(0).nonzero().flatten()[:6].tolist()}..., scales in "
                    f"{int(bad_s.any(1).sum())} rows / cols "
                    f"{bad_s.any(0).nonzero().flatten()[:6].tolist()}"
                )
            buf.destroy()
    return lines


if __name__ == "__main__":
    print("\n".join(run_ranks(_rank, 1, device="cuda", timeout_s=300)[0]), flush=True)
