"""Speculative decoding's speed against its acceptance: decode tokens/s with drafts that hold at a
controlled rate, without speculation as the baseline, in the same process and sitting.

    python -m splitmoe.bench.spec_bench --model q3_24l.gguf [--expert-services 1] [--streams 1 16]

Random weights accept nothing a real drafter proposes, so the drafter here is an oracle: a first
run without speculation records each stream's greedy continuation; then each drafted token is that
continuation's next token with probability `acceptance`, else a wrong one (so a draft holds token by
token at about that rate, like a drafter of that quality). Each acceptance is run without
speculation, with K fixed (`--num-speculative-tokens`, every step drafts K) and with the engine's
own adaptive length, in turn (ratios against the run beside them: the machine's bandwidth drifts).
Outputs are checked equal to the baseline's (float32 or not: the drafts change which tokens are
verified together, and bfloat16 may round a near-tie differently in a multi-token step: counted,
not failed). The attention side runs in this process (the engine, no HTTP); with
`--expert-services N` the routed experts run in N `serve-experts` processes over shared memory.

`--drafter mtp` (a file with a NextN block: `splitmoe bench make-model --nextn 1`): each proposal
runs the file's MTP block for real (its passes, its hops to the experts), then proposes the
oracle's tokens: the speed a trained MTP block of that acceptance gives, its own cost included.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

PROMPT_TOKENS = 16


def start_services(model: Path, num: int, threads: int, token: str, log_dir: Path) -> tuple[list, list[str]]:
    from splitmoe.runtime.settings import CLUSTER_TOKEN_ENV
    from splitmoe.supervisor import free_port

    env = {**os.environ, CLUSTER_TOKEN_ENV: token, "PYTHONUNBUFFERED": "1"}
    procs, addresses = [], []
    for i in range(num):
        port = free_port()
        procs.append(subprocess.Popen([sys.executable, "-m", "splitmoe", "serve-experts", str(model), "--port", str(port),
                                       "--unassigned", "--threads", str(threads)],
                                      stdout=open(log_dir / f"expert-{i}.log", "wb"), stderr=subprocess.STDOUT, env=env))
        addresses.append(f"127.0.0.1:{port}")
    return procs, addresses


def oracle(references: dict[tuple[int, ...], list[int]], acceptance: float, vocab: int, seed: int = 0):
    """A drafter proposing each stream's recorded continuation, each token right with probability
    `acceptance` (a wrong token otherwise)."""
    rng = random.Random(seed)
    by_prompt = {prompt: cont for prompt, cont in references.items()}

    def draft(tokens, k):
        for prompt, cont in by_prompt.items():
            if tuple(tokens[:len(prompt)]) == prompt:
                at = len(tokens) - len(prompt)
                truth = cont[at:at + k]
                return [t if rng.random() < acceptance else (t + 1 + rng.randrange(vocab - 1)) % vocab for t in truth]
        return []
    return draft


def costed(drafter, propose):
    """A drafter that does `drafter`'s work on every proposal but proposes `propose`'s tokens."""
    from splitmoe.attention_service.engine.speculation import Drafter

    class Costed(Drafter):
        def propose(self, key, tokens, num_tokens):
            drafter.propose(key, tokens, num_tokens)
            return propose(tokens, num_tokens)

        def release(self, key):
            drafter.release(key)

    return Costed()


def run_batch(model, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float]:
    """Every prompt at once (greedy); (outputs, decode seconds: first token out to the last)."""
    from splitmoe.attention_service.engine.sampling import SamplingOptions

    options = SamplingOptions(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    done, first = threading.Semaphore(0), []
    requests = []
    lock = threading.Lock()

    def sink(out):
        with lock:
            if not first and out.num_output_tokens:
                first.append(time.perf_counter())
        if out.finished:
            done.release()

    for i, ids in enumerate(prompts):
        requests.append(model.new_request(f"b{time.monotonic_ns()}-{i}", list(ids), options, sink))
    for r in requests:
        model.engine.submit(r)
    for _ in prompts:
        assert done.acquire(timeout=1800)
    end = time.perf_counter()
    outputs = [r.seq.token_ids[r.num_prompt_tokens:] for r in requests]
    # the first token of every stream comes with its prompt: the decode tokens are the rest
    return outputs, end - first[0]


def measure(args) -> dict:
    import torch

    from splitmoe.attention_service.engine.speculation import FunctionDrafter, SpeculationSettings, ngram_drafter
    from splitmoe.attention_service.expert_backends.remote import RemoteExpertsSettings
    from splitmoe.attention_service.model.runner import DTYPES, RunnerOptions
    from splitmoe.attention_service.service import load_serving_model
    from splitmoe.attention_service.settings import AttentionSettings
    from splitmoe.runtime.cluster_auth import ClusterSecurity

    torch.set_num_threads(args.threads)
    args.dir.mkdir(parents=True, exist_ok=True)
    token = "spec-bench-secret-" + os.urandom(8).hex()
    procs, experts = [], None
    if args.expert_services:
        procs, addresses = start_services(args.model, args.expert_services, args.threads, token, args.dir)
        experts = RemoteExpertsSettings(addresses=tuple(addresses), transport="shm", startup_wait_s=300,
                                        security=ClusterSecurity(token=token), resolve_interval_s=0)
    runner = RunnerOptions(dtype=DTYPES[args.dtype], device=torch.device("cpu"), kv_cache_tokens=16384)
    model = load_serving_model(AttentionSettings(model_path=str(args.model), runner=runner, experts=experts,
                                                 max_running_seqs=64, max_batch_tokens=1024,
                                                 speculation=SpeculationSettings(args.drafter, args.num_speculative_tokens,
                                                                                 max_batch_seqs=64)))
    mtp = model.engine.drafter if args.drafter == "mtp" else None
    vocab = model.runner.cfg.vocab_size
    gen = torch.Generator().manual_seed(0)
    rows = []
    model.engine.start()
    try:
        for streams in args.streams:
            prompts = [torch.randint(10, vocab - 10, (PROMPT_TOKENS,), generator=gen).tolist() for _ in range(streams)]
            engine = model.engine
            engine.speculation = SpeculationSettings("none")
            run_batch(model, prompts, 4)  # warm-up
            base_out, _ = run_batch(model, prompts, args.max_tokens)
            references = {tuple(p): o for p, o in zip(prompts, base_out)}
            for acceptance in args.acceptance:
                # off, fixed K at any batch (what speculation costs), the engine's defaults (adaptive
                # length, none past 8 streams): side by side, as the machine's bandwidth drifts
                runs = (("off", SpeculationSettings("none")),
                        ("fixed K", SpeculationSettings("ngram", args.num_speculative_tokens, max_batch_seqs=64,
                                                        fixed_length=True)),
                        ("adaptive", SpeculationSettings("ngram", args.num_speculative_tokens)))
                off_tok_s = None
                for mode, settings in runs:
                    engine.speculation = settings
                    drafts = oracle(references, acceptance, vocab)
                    engine.drafter = costed(mtp, drafts) if mtp is not None else FunctionDrafter(drafts)
                    before = (engine.spec_stats.num_draft_tokens, engine.spec_stats.num_accepted_tokens)
                    out, seconds = run_batch(model, prompts, args.max_tokens)
                    drafted = engine.spec_stats.num_draft_tokens - before[0]
                    accepted = engine.spec_stats.num_accepted_tokens - before[1]
                    tok_s = streams * (args.max_tokens - 1) / seconds
                    off_tok_s = off_tok_s or tok_s
                    rows.append({"streams": streams, "acceptance": acceptance, "mode": mode, "tok_s": round(tok_s, 1),
                                 "vs_off": round(tok_s / off_tok_s, 2),
                                 "accepted_share": round(accepted / drafted, 2) if drafted else None,
                                 "outputs_differing": sum(o != b for o, b in zip(out, base_out))})
                    print(json.dumps(rows[-1]), flush=True)
            engine.drafter = mtp or ngram_drafter(engine.speculation)
    finally:
        model.engine.stop()
        model.experts.close()
        for p in procs:
            p.kill()
            p.wait()
    return {"model": str(args.model), "dtype": args.dtype, "threads": args.threads, "drafter": args.drafter,
            "expert_services": args.expert_services, "num_speculative_tokens": args.num_speculative_tokens,
            "max_tokens": args.max_tokens, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m splitmoe.bench.spec_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--dir", type=Path, default=Path("/tmp/spec-bench"), help="the services' logs")
    p.add_argument("--expert-services", type=int, default=0, help="0: the experts in this process")
    p.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    p.add_argument("--acceptance", type=float, nargs="+", default=[0.0, 0.5, 0.7, 0.9])
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--drafter", choices=["ngram", "mtp"], default="ngram",
                   help="ngram: the oracle's tokens at no cost; mtp: the file's MTP block run for each proposal")
    args = p.parse_args(argv)
    report = measure(args)
    text = json.dumps(report, indent=1)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
