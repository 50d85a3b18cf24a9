"""`splitmoe rebalance`: re-place the experts by their measured heat, while the stack serves.

The attention service plans from the decayed tokens-per-second of every (layer, expert): which
experts it keeps itself (--local-experts-by-heat), which expert service hosts which, and which
hot experts get replicas; the services load the new placement beside the old, the attention
service switches between two layer calls and the old experts are released. No request fails.
"""
from __future__ import annotations

import argparse

from splitmoe.commands.attention_target import add_attention_target_flags, attention_channel


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("rebalance", help="move the experts between the services by measured load, while serving")
    p.add_argument("--dry-run", action="store_true", help="plan and report; move nothing")
    add_attention_target_flags(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import grpc

    from splitmoe.proto import attention_pb2 as pb
    from splitmoe.proto.attention_pb2_grpc import AttentionServiceStub

    address, channel = attention_channel(args)
    with channel:
        try:
            r = AttentionServiceStub(channel).Rebalance(pb.RebalanceRequest(dry_run=args.dry_run),
                                                        timeout=args.timeout_s)
        except grpc.RpcError as e:
            print(f"splitmoe rebalance: {address}: {e.code().name}: {e.details()}")
            return 1
    what = "rebalanced" if r.changed else ("would rebalance" if args.dry_run else "unchanged")
    print(f"{address}: {what}: imbalance (max/mean tokens per expert service) {r.imbalance_before:.3f} -> "
          f"{r.imbalance_after:.3f}; {r.num_loaded} (layer, expert) pairs loaded, {r.num_local} computed by the "
          f"attention service; {r.seconds:.2f} s ({r.reason})")
    return 0
