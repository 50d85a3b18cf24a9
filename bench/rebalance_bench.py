"""Placement by load, measured: imbalance and 16-stream decode before and after a rebalance,
through two and three expert services, on a model whose router favours a few experts per layer;
and the decode speed with the hottest experts kept in the attention process.

    python -m splitmoe.bench.rebalance_bench --dir /tmp/rebalance-bench [--shape olmoe-1b-7b --layers 2]

The model is `splitmoe bench make-model`'s (random weights, a real model's dimensions, its first
`--layers` layers, a small vocabulary) made skewed by bench/skewed_model.py. The expert services
are real `serve-experts` processes on loopback (each an even expert range at start, `--threads`
threads each); the attention side runs in this process (bfloat16 fast path) so that the steps are
timed without HTTP in between. Per service count: prefill `--streams` prompts, decode a few steps
(the heat), rebalance; then the even placement and the placement by load are timed in turn,
`--rounds` times each (`--steps` decode steps of all streams together, after two of warm-up), as
the load of a shared machine drifts. Likewise the hottest experts kept in the attention process
against none. Imbalance: max over mean routed tokens per expert service per layer call, measured
on the timed steps (what the services were sent), and as the planner predicted it from the heat.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

NUM_PROMPT_TOKENS = 32


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def make_models(args) -> Path:
    from splitmoe.bench.make_model import write_model
    from splitmoe.bench.skewed_model import write_skewed

    args.dir.mkdir(parents=True, exist_ok=True)
    base = args.dir / f"{args.shape}-{args.layers}l-{args.quant}.gguf"
    if not base.exists():
        write_model(base, args.shape, args.layers, args.quant, vocab=args.vocab)
    skewed = args.dir / f"{base.stem}-skewed{args.strength:g}x{args.hot_per_layer}.gguf"
    if not skewed.exists():
        write_skewed(base, skewed, per_layer=args.hot_per_layer, strength=args.strength)
    return skewed


def start_services(model: Path, num_services: int, threads: int, token: str, log_dir: Path) -> tuple[list, list[str]]:
    from splitmoe.local_stack import expert_ranges
    from splitmoe.modelfile.expert_tensors import expert_count
    from splitmoe.modelfile.gguf_file import GGUFFile
    from splitmoe.runtime.settings import CLUSTER_TOKEN_ENV
    from splitmoe.supervisor import free_port

    env = {**os.environ, CLUSTER_TOKEN_ENV: token, "OMP_WAIT_POLICY": "PASSIVE", "PYTHONUNBUFFERED": "1"}
    procs, addresses = [], []
    for i, (first, last) in enumerate(expert_ranges(expert_count(GGUFFile(model)), num_services)):
        port = free_port()
        log = open(log_dir / f"expert-{num_services}-{i}.log", "wb")
        procs.append(subprocess.Popen([sys.executable, "-m", "splitmoe", "serve-experts", str(model), "--port", str(port),
                                       "--experts", f"{first}-{last}", "--threads", str(threads)],
                                      stdout=log, stderr=subprocess.STDOUT, env=env))
        addresses.append(f"127.0.0.1:{port}")
    return procs, addresses


def decode(runner, seqs, steps: int) -> float:
    """Seconds for `steps` greedy decode steps of every sequence together."""
    start_s = time.perf_counter()
    for _ in range(steps):
        logits = runner.step(seqs, [1] * len(seqs))
        for seq, token in zip(seqs, logits.argmax(-1).tolist()):
            seq.token_ids.append(token)
    return time.perf_counter() - start_s


def measured_imbalance(backend, earlier):
    from splitmoe.attention_service.expert_backends.services import imbalance_between

    return imbalance_between(earlier, backend.imbalance_meter())[0]


def timed_phase(backend, runner, seqs, steps: int) -> tuple[float, float]:
    """(decode tok/s of every stream together, measured imbalance) over `steps` steps."""
    decode(runner, seqs, 2)  # warm-up: the new placement's pages, the kernels' buffers
    reading = backend.imbalance_meter()
    seconds = decode(runner, seqs, steps)
    return len(seqs) * steps / seconds, measured_imbalance(backend, reading)


def alternate(backend, runner, seqs, placements: dict, args) -> dict:
    """Each placement in turn, `--rounds` times (the machine's load drifts: interleaving spreads
    it over all of them); the median and every figure per placement."""
    figures = {name: [] for name in placements}
    for _ in range(args.rounds):
        for name, saved in placements.items():
            backend.restore_placement(saved)
            figures[name].append(timed_phase(backend, runner, seqs, args.steps))
    return {name: {"tok_s": round(statistics.median(f[0] for f in runs), 1),
                   "imbalance": round(statistics.median(f[1] for f in runs), 3),
                   "tok_s_each": [round(f[0], 1) for f in runs]} for name, runs in figures.items()}


@contextlib.contextmanager
def decoding(model: Path, addresses: list[str], args, token: str, local_by_heat: str = "", heat_file: str = ""):
    """(the remote backend, a runner on it, `--streams` sequences prefilled)."""
    from splitmoe.attention_service.expert_backends.load_plan import HeatBudget
    from splitmoe.attention_service.expert_backends.remote import RemoteExperts, RemoteExpertsSettings
    from splitmoe.attention_service.model.runner import ModelRunner, RunnerOptions
    from splitmoe.attention_service.model.sequence import Sequence
    from splitmoe.modelfile.gguf_file import GGUFFile
    from splitmoe.runtime.cluster_auth import ClusterSecurity

    settings = RemoteExpertsSettings(addresses=tuple(addresses), security=ClusterSecurity(token=token),
                                     startup_wait_s=600, expert_timeout_s=120, heat_file=heat_file,
                                     local_by_heat=HeatBudget.parse(local_by_heat or "0"))
    backend = RemoteExperts(GGUFFile(model), settings)
    try:
        tokens_per_seq = NUM_PROMPT_TOKENS + (2 + args.steps) * args.rounds * 4 + 16
        runner = ModelRunner.from_gguf(model, RunnerOptions(dtype=torch.bfloat16, device=torch.device("cpu"),
                                                            kv_cache_tokens=args.streams * tokens_per_seq),
                                       experts=backend)
        gen = torch.Generator().manual_seed(0)
        seqs = [Sequence(i, torch.randint(0, runner.cfg.vocab_size, (NUM_PROMPT_TOKENS,), generator=gen).tolist())
                for i in range(args.streams)]
        with torch.inference_mode():
            for seq, token in zip(seqs, runner.step(seqs).argmax(-1).tolist()):  # the prefill
                seq.token_ids.append(token)
            decode(runner, seqs, 4)  # the heat of the even placement, for the plan
            yield backend, runner, seqs
    finally:
        backend.close()


def busiest_share(tokens: torch.Tensor, num_busiest: int) -> float:
    """The share of routed tokens that each layer's `num_busiest` busiest experts took (the skew)."""
    used = tokens[tokens.sum(dim=1) > 0].double()
    return round(float(used.topk(num_busiest, dim=1).values.sum() / used.sum()), 3)


def measure_rebalance(model: Path, addresses: list[str], args, token: str, heat_file: str) -> dict:
    with decoding(model, addresses, args, token, heat_file=heat_file) as (backend, runner, seqs):
        even = backend.placement_now()
        report = backend.rebalance()
        by_load = backend.placement_now()
        result = alternate(backend, runner, seqs, {"even": even, "by load": by_load}, args)
        result["busiest_share"] = busiest_share(backend.expert_heat().tokens, args.hot_per_layer)
    result["rebalance"] = {"changed": report.changed, "predicted_before": round(report.imbalance_before, 3),
                           "predicted_after": round(report.imbalance_after, 3), "pairs_loaded": report.num_loaded,
                           "seconds": round(report.seconds, 2)}
    return result


def measure_hot_local(model: Path, addresses: list[str], args, token: str, heat_file: str) -> dict:
    with decoding(model, addresses, args, token, args.local_experts_by_heat, heat_file) as (backend, runner, seqs):
        placement, hot = backend.placement_now()
        result = alternate(backend, runner, seqs, {"all remote": (placement, None), "hottest local": (placement, hot)},
                           args)
    result["local_pairs"] = len(hot.keys) if hot is not None else 0
    result["local_bytes"] = hot.num_bytes if hot is not None else 0
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m splitmoe.bench.rebalance_bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--dir", type=Path, required=True, help="models, logs and results.json go here")
    p.add_argument("--shape", default="olmoe-1b-7b", choices=["qwen3-30b-a3b", "olmoe-1b-7b"])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--quant", default="q4_0", choices=["q4_k_m", "q4_0", "q8_0"])
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--hot-per-layer", type=int, default=4, help="experts per layer the router favours")
    p.add_argument("--strength", type=float, default=3.0, help="how much (router logits are of order one)")
    p.add_argument("--services", default="2,3", help="expert service counts to measure")
    p.add_argument("--threads", type=int, default=1, help="threads per expert service")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--steps", type=int, default=16, help="decode steps timed per phase")
    p.add_argument("--rounds", type=int, default=3, help="times each placement is timed, interleaved")
    p.add_argument("--local-experts-by-heat", default="", help="also measure 2 services with this budget kept local")
    args = p.parse_args(argv)
    from splitmoe.runtime.settings import new_cluster_token

    model = make_models(args)
    token = new_cluster_token()
    results = {"cpu": cpu_name(), "cpus": os.cpu_count(), "model": model.name, "streams": args.streams,
               "steps": args.steps, "rounds": args.rounds, "threads_per_service": args.threads, "configs": {}}
    for num_services in (int(n) for n in args.services.split(",")):
        procs, addresses = start_services(model, num_services, args.threads, token, args.dir)
        try:
            heat_file = str(args.dir / f"heat-{num_services}.json")
            Path(heat_file).unlink(missing_ok=True)
            key = f"{num_services} services"
            results["configs"][key] = measure_rebalance(model, addresses, args, token, heat_file)
            print(json.dumps({key: results["configs"][key]}), flush=True)
            if args.local_experts_by_heat and num_services == 2:
                key = f"2 services, hottest {args.local_experts_by_heat} local"
                results["configs"][key] = measure_hot_local(model, addresses, args, token, heat_file)
                print(json.dumps({key: results["configs"][key]}), flush=True)
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                proc.wait(30)
    (args.dir / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
