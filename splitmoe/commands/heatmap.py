"""`splitmoe heatmap FILE.png|FILE.svg`: draw the heat of every (layer, expert) and the current
placement of a running attention service (or of the stack `splitmoe up` started most recently)."""
from __future__ import annotations

import argparse

from splitmoe.commands.attention_target import add_attention_target_flags, attention_channel


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("heatmap", help="draw per-(layer, expert) heat and the current placement (PNG or SVG)")
    p.add_argument("output", help="the picture to write: .png or .svg")
    add_attention_target_flags(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import grpc

    from splitmoe.heatmap import draw_heatmap
    from splitmoe.proto import attention_pb2 as pb
    from splitmoe.proto.attention_pb2_grpc import AttentionServiceStub

    if not args.output.lower().endswith((".png", ".svg")):
        raise ValueError(f"{args.output}: want a .png or .svg file")
    address, channel = attention_channel(args)
    with channel:
        try:
            stats = AttentionServiceStub(channel).GetStats(pb.AttentionStatsRequest(), timeout=args.timeout_s)
        except grpc.RpcError as e:
            print(f"splitmoe heatmap: {address}: {e.code().name}: {e.details()}")
            return 1
    if not stats.expert_heat:
        print(f"splitmoe heatmap: {address} reports no expert heat (no routed experts?)")
        return 1
    num_layers = 1 + max(e.layer for e in stats.expert_heat)
    num_experts = 1 + max(e.expert for e in stats.expert_heat)
    rates = [[0.0] * num_experts for _ in range(num_layers)]
    placed_on = {}
    for e in stats.expert_heat:
        rates[e.layer][e.expert] = e.tokens_per_s
        if e.placed_on:
            placed_on[(e.layer, e.expert)] = tuple(e.placed_on)
    title = f"{address}: imbalance since the last rebalance {stats.expert_imbalance:.2f} (max/mean per service)"
    print(draw_heatmap(rates, placed_on, args.output, title))
    return 0
