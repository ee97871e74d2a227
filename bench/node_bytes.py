"""Bytes per stage per rank across nodes at S1, from routings drawn like the benchmark's.

    python bench/node_bytes.py > bench/results/<date>-node-bytes-S1.md

For nodes of 8 GPUs at EP16/32/64, with uniform routing (top-8 of 256 experts) and node-limited
routing (each token's 8 experts drawn from 4 of the nodes, as DeepSeek-V3 routes), counts for
rank 0: the rows it puts over the network (one per token and other node holding one of its
experts), the ranks its node's forwarders copy each landed row to, the rows it sends over NVLink
(own tokens to the other ranks of its node, and forwarded rows), the network bytes with the
slot metadata of runtime.planner.NetSlot, and the time they take at 50 GB/s per NIC.
"""

import torch

TOKENS, HIDDEN, EXPERTS, TOPK, PER_NODE = 4096, 7168, 256, 8, 8
NIC_GBPS = 50


def _route(nodes: int, node_limited: bool, gen: torch.Generator) -> torch.Tensor:
    per_node = EXPERTS // nodes
    if node_limited and nodes > 4:
        chosen = torch.rand(TOKENS, nodes, generator=gen).topk(4, dim=1).indices
        candidates = (chosen[:, :, None] * per_node + torch.arange(per_node)).reshape(TOKENS, -1)
        pick = torch.rand(candidates.shape, generator=gen).topk(TOPK, dim=1).indices
        return candidates.gather(1, pick)
    return torch.rand(TOKENS, EXPERTS, generator=gen).topk(TOPK, dim=1).indices


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    print("| EP | nodes | routing | network rows / rank | of a token | ranks per forwarded row "
          "| NVLink rows out / rank | network MB / rank, bf16 (FP8) | metadata "
          f"| at {NIC_GBPS} GB/s per NIC, bf16 (FP8) |")  # fmt: skip
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for world in (16, 32, 64):
        nodes, local = world // PER_NODE, EXPERTS // world
        meta_stride = min(local, 32)
        for node_limited in (False, True):
            if node_limited and nodes <= 4:
                continue  # every node is among the 4
            rank_of = _route(nodes, node_limited, gen) // local  # rank 0 sends
            hit_ranks = torch.zeros(TOKENS, world, dtype=torch.bool).scatter_(1, rank_of, True)
            hit_nodes = hit_ranks.view(TOKENS, nodes, PER_NODE).any(dim=2)
            net_rows = int(hit_nodes[:, 1:].sum())
            forwarded = int(hit_ranks[:, PER_NODE:].sum())
            nvlink_rows = int(hit_ranks[:, 1:PER_NODE].sum()) + forwarded
            meta = PER_NODE * (1 + 2 * meta_stride) * 4
            bf16, fp8 = HIDDEN * 2, HIDDEN + HIDDEN // 128 * 4
            mb = [net_rows * (row + meta) / 1e6 for row in (bf16, fp8)]
            us = [m * 1e6 / (NIC_GBPS * 1e9) * 1e6 for m in mb]  # MB at GB/s, in µs
            routing = "node-limited (4 nodes)" if node_limited else "uniform"
            print(f"| EP{world} | {nodes}×{PER_NODE} | {routing} | {net_rows} | "
                  f"{net_rows / TOKENS:.2f} | {forwarded / max(net_rows, 1):.2f} | {nvlink_rows} | "
                  f"{mb[0]:.1f} ({mb[1]:.1f}) | {meta / bf16:.1%} | "
                  f"{us[0]:.0f} µs ({us[1]:.0f} µs) |")  # fmt: skip


if __name__ == "__main__":
    main()
