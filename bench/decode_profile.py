"""Where a decode token's time goes: every op of the attention side and the experts, per token.

    python -m splitmoe.bench.decode_profile --model q3_6l.gguf --threads 2 [--tokens 64] [--context 64]
    SPLITMOE_CLUSTER_TOKEN=... python -m splitmoe.bench.decode_profile --model q3_6l.gguf --expert-services 127.0.0.1:50061

Runs the model's own decode steps (one stream, greedy) with the functions that make up a step
wrapped by timers, after a prompt of `--context` tokens, and prints each one's microseconds per
token and per layer, and the part of the step no wrapped function accounts for (Python between
them, allocation). The timers cost about a microsecond a call; the unwrapped step time is
measured first and printed beside the wrapped one. With `--expert-services` the experts are the
real services (the time under "experts" is then the hop: post, wait, wake-up and their compute).
"""
from __future__ import annotations

import argparse
import time
from collections import defaultdict
from contextlib import contextmanager

import splitmoe  # noqa: F401 - first: the runtimes' defaults, before torch loads (splitmoe/__init__.py)

# isort: split
import torch


class Timers:
    """Wraps callables in modules or classes so each call's wall time adds to a label."""

    def __init__(self) -> None:
        self.total_s: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._undo: list[tuple[object, str, object]] = []
        self._depth = 0

    def wrap(self, owner: object, name: str, label: str | None = None, label_of=None) -> None:
        """Time owner.name under `label`, or under label_of(*args) when that gives one."""
        real = getattr(owner, name)
        timers = self

        def timed(*args, **kwargs):
            if timers._depth:  # inside another timed call: counted there
                return real(*args, **kwargs)
            key = (label_of(*args) if label_of else None) or label or name
            timers._depth += 1
            t0 = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                timers.total_s[key] += time.perf_counter() - t0
                timers.calls[key] += 1
                timers._depth -= 1

        self._undo.append((owner, name, real))
        setattr(owner, name, timed)

    def restore(self) -> None:
        for owner, name, real in reversed(self._undo):
            setattr(owner, name, real)
        self._undo.clear()

    def reset(self) -> None:
        self.total_s.clear()
        self.calls.clear()


def instrument(runner, timers: Timers) -> None:
    """Wrap the pieces of a decode step of `runner` (a ModelRunner)."""
    from splitmoe.attention_service.expert_backends.direct_hop import RemoteMoELayer
    from splitmoe.attention_service.model import attention, mla, transformer
    from splitmoe.attention_service.model.kv_cache import KVCache
    from splitmoe.attention_service.model.layers import Rope
    from splitmoe.kernels.decode_layer import AttentionFront
    from splitmoe.kernels.decode_moe_layer import LocalMoELayer
    from splitmoe.kernels.linear import LinearGroup, QuantEmbedding

    w = runner.model.weights
    names = {id(w.output): "lm_head"}
    for layer in w.layers:
        a = layer.attn
        for attr, label in (("q", "attn q/k/v"), ("k", "attn q/k/v"), ("v", "attn q/k/v"), ("out", "attn out"),
                            ("q_a", "attn q/k/v"), ("kv_a", "attn q/k/v")):
            if getattr(a, attr, None) is not None:
                names[id(getattr(a, attr))] = label
        if layer.moe is not None:
            names[id(layer.moe.router)] = "router linear"
            if layer.moe.shared is not None:
                for m in (layer.moe.shared.gate, layer.moe.shared.up, layer.moe.shared.down):
                    names[id(m)] = "shared expert"

    for layer in w.layers:
        if hasattr(layer.attn, "qkv"):  # multi-head attention's fused q/k/v (MLA has none)
            names[id(layer.attn.qkv)] = "attn q/k/v"
        for ffn, label in ((layer.dense_ffn, "dense ffn"), (layer.moe and layer.moe.shared, "shared expert")):
            if ffn is not None:
                names[id(ffn.gate_up)] = label
                names[id(ffn.down)] = label

    def linear_label(x, weight, *rest):
        return names.get(id(weight), "other linear")

    for module in (attention, mla, transformer):
        timers.wrap(module, "linear", label_of=linear_label)
    for module in (attention, mla):
        timers.wrap(module, "rms_norm", "norm")
    timers.wrap(runner.model, "norm", "norm")  # the architecture's norm (RMSNorm or LayerNorm), bound at init
    timers.wrap(LinearGroup, "__call__", label_of=lambda group, *rest: names.get(id(group), "other linear"))
    timers.wrap(AttentionFront, "__call__", "attention front (native, fused)")
    timers.wrap(LocalMoELayer, "__call__", "layer (fused: front+experts)")
    timers.wrap(RemoteMoELayer, "__call__", "layer (fused: front+hop)")
    timers.wrap(transformer.MoETransformer, "shared_ffn", "shared expert")
    timers.wrap(attention, "decode_attention", "attention (native)")
    timers.wrap(mla, "decode_attention", "attention (native)")
    timers.wrap(attention, "grouped_attention", "attention (torch)")
    timers.wrap(mla, "latent_attention", "attention (torch)")
    timers.wrap(mla, "per_head", "MLA per-head maps")
    timers.wrap(Rope, "__call__", "rope")
    timers.wrap(KVCache, "write", "kv write")
    timers.wrap(transformer, "route", "routing (softmax, top-k)")
    timers.wrap(runner.model.experts, "forward", "experts")
    timers.wrap(QuantEmbedding, "__getitem__", "embedding")


def hop_summary(before: dict, after: dict, steps: int) -> str:
    """The unwrapped steps' hops to the expert services: per hop, the service's compute and the rest
    of the round trip; "" without services."""
    n = sum(a.num_hops - before[k].num_hops for k, a in after.items() if k in before)
    if not n:
        return ""
    hop_s = sum(a.hop_s_total - before[k].hop_s_total for k, a in after.items() if k in before)
    compute_s = sum(a.compute_s_total - before[k].compute_s_total for k, a in after.items() if k in before)
    return (f"hops: {n / steps:.1f} a step; per hop {hop_s / n * 1e6:.1f} us round trip, {compute_s / n * 1e6:.1f} us "
            f"computing in the service, {(hop_s - compute_s) / n * 1e6:.1f} us the rest")


def decode_tokens(runner, seqs, n: int, sample) -> float:
    """Seconds for n decode steps of `seqs` together (greedy)."""
    t0 = time.perf_counter()
    for _ in range(n):
        logits = runner.step(seqs, [1] * len(seqs))
        for seq, row in zip(seqs, logits):
            seq.token_ids.append(sample(row))
    return time.perf_counter() - t0


@contextmanager
def loaded(args):
    from splitmoe.attention_service.model.runner import ModelRunner, RunnerOptions

    experts = None
    if args.expert_services:
        from splitmoe.attention_service.expert_backends.remote import RemoteExperts, RemoteExpertsSettings
        from splitmoe.modelfile.gguf_file import GGUFFile
        from splitmoe.runtime.cluster_auth import ClusterSecurity
        from splitmoe.runtime.settings import cluster_token

        settings = RemoteExpertsSettings(addresses=tuple(args.expert_services.split(",")), transport=args.transport,
                                         security=ClusterSecurity(token=cluster_token()))
        experts = RemoteExperts(GGUFFile(args.model), settings)
    runner = ModelRunner.from_gguf(args.model, RunnerOptions(dtype=getattr(torch, args.dtype), device=torch.device("cpu"),
                                                             kv_cache_tokens=args.streams * (args.context + 2 * args.tokens + 64)),
                                   experts=experts)
    try:
        yield runner
    finally:
        if experts is not None:
            experts.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m splitmoe.bench.decode_profile", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", required=True, help="GGUF file")
    p.add_argument("--threads", type=int, default=0, help="torch and native threads (0: torch's default)")
    p.add_argument("--tokens", type=int, default=64, help="decode steps timed")
    p.add_argument("--context", type=int, default=64, help="prompt tokens before the timed steps")
    p.add_argument("--streams", type=int, default=1, help="sequences decoding together (a step's rows)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="the attention side's path")
    p.add_argument("--expert-services", default="", help="host:port,... (default: experts in-process)")
    p.add_argument("--transport", default="auto", choices=["auto", "grpc", "shm"], help="with --expert-services")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from splitmoe.attention_service.engine import sampling
    from splitmoe.attention_service.model.sequence import Sequence
    from splitmoe.kernels.expert_kernels import sync_native_threads

    def sample(row: torch.Tensor) -> int:
        return sampling._argmax(row)  # looked up at each call: the timers wrap it

    sync_native_threads()
    with loaded(args) as runner, torch.inference_mode():
        cfg = runner.cfg
        # Random prompts, as the bench draws them: streams that route alike would read fewer experts.
        rng = torch.Generator().manual_seed(0)
        seqs = [Sequence(s, torch.randint(cfg.vocab_size, (args.context,), generator=rng).tolist())
                for s in range(args.streams)]
        prefill_s = time.perf_counter()
        for seq, row in zip(seqs, runner.step(seqs)):  # the prefill
            seq.token_ids.append(sample(row))
        prefill_s = time.perf_counter() - prefill_s
        decode_tokens(runner, seqs, 8, sample)  # warm-up
        hops_before = runner.model.experts.stats()
        plain_s = decode_tokens(runner, seqs, args.tokens, sample)
        hops = hop_summary(hops_before, runner.model.experts.stats(), args.tokens)
        timers = Timers()
        instrument(runner, timers)
        timers.wrap(sampling, "_argmax", "sampling (argmax)")
        decode_tokens(runner, seqs, 4, sample)
        timers.reset()
        wrapped_s = decode_tokens(runner, seqs, args.tokens, sample)
        timers.restore()
    n = args.tokens
    per_token_us = {k: v / n * 1e6 for k, v in timers.total_s.items()}  # per step
    step_us = wrapped_s / n * 1e6
    accounted = sum(per_token_us.values())
    print(f"{args.model}: {cfg.arch}, {cfg.num_layers} layers, {args.dtype}, threads {torch.get_num_threads()}, "
          f"context {args.context}..{args.context + 12 + 2 * n}, experts "
          f"{'over ' + args.expert_services if args.expert_services else 'in-process'}")
    print(f"prefill of {args.streams} x {args.context} tokens: {prefill_s * 1e3:.0f} ms "
          f"({args.streams * args.context / prefill_s:.1f} tok/s, one step, cold)")
    print(f"decode step of {args.streams} stream(s): {plain_s / n * 1e3:.2f} ms ({n * args.streams / plain_s:.1f} tok/s) "
          f"unwrapped, {step_us / 1e3:.2f} ms wrapped")
    if hops:
        print(hops)
    print(f"{'what':32s} {'us/step':>9s} {'us/layer':>9s} {'calls/step':>11s} {'share':>6s}")
    rows = sorted(per_token_us.items(), key=lambda kv: -kv[1]) + [("(unaccounted: Python between ops)", step_us - accounted)]
    for label, us in rows:
        calls = timers.calls.get(label, 0) / n
        print(f"{label:32s} {us:9.1f} {us / cfg.num_layers:9.1f} {calls:11.1f} {us / step_us:6.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
