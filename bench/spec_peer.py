"""Speculative decoding side by side with llama.cpp's: llama-server and `splitmoe up` on the same
file, the same prompt ids, greedy, one stream, each without speculation and with prompt lookup.

    python -m splitmoe.bench.spec_peer --model q3_24l.gguf --llama-server BUILD/bin/llama-server

llama-server runs `--spec-type ngram-simple` (its prompt lookup) with its defaults (a 12-token
match drafts up to 48) and with a 4-token match drafting K, and reports its own decode rate and
draft counts (`timings`); `splitmoe up --expert-services 1 --speculative
ngram --num-speculative-tokens K` is timed from its token stream (first token to last) and its
draft counts read from /metrics. Random weights make greedy text that repeats itself, which is
what prompt lookup drafts from: each engine's acceptance is its own output's, reported beside its
speed. Everything runs with the same threads, one engine at a time.

`--demo`: the trained demo model instead, as a real case of prompt lookup on a model's own
answers: `splitmoe up` alone (no expert services: the demo is tiny), the demo's capital questions
one after another over the chat API, tokens/s over all answers, with and without `--speculative ngram`.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def post(url: str, body: dict, timeout_s: float = 600.0) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.load(response)


def wait_healthy(url: str, process: subprocess.Popen, timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args[0]} exited with {process.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} did not answer within {timeout_s:g} s")


def stop(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


LLAMA_SETTINGS = {"plain": [], "ngram-simple": ["--spec-type", "ngram-simple"],
                  "ngram-simple 4/K": ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "4",
                                       "--spec-ngram-simple-size-m", "{K}"]}


def llama_server(args, prompt: list[int], setting: str) -> dict:
    port = free_port()
    command = [str(args.llama_server), "-m", str(args.model), "-t", str(args.threads), "-c", "4096", "-np", "1",
               "--port", str(port), "--no-webui"]
    command += [a.format(K=args.num_speculative_tokens) for a in LLAMA_SETTINGS[setting]]
    log = open(args.dir / f"llama-server-{setting.replace(' ', '-').replace('/', '-')}.log", "wb")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(f"http://127.0.0.1:{port}/health", process)
        body = {"prompt": prompt, "n_predict": args.max_tokens, "temperature": 0.0, "top_k": 1,
                "cache_prompt": False, "ignore_eos": True, "return_tokens": True}
        post(f"http://127.0.0.1:{port}/completion", {**body, "n_predict": 8})  # warm-up
        runs = [post(f"http://127.0.0.1:{port}/completion", body) for _ in range(args.repeats)]
    finally:
        stop(process)
    best = max(runs, key=lambda r: r["timings"]["predicted_per_second"])
    t = best["timings"]
    return {"engine": "llama.cpp", "speculative": setting, "tok_s": round(t["predicted_per_second"], 1),
            "draft_tokens": t.get("draft_n", 0), "accepted": t.get("draft_n_accepted", 0),
            "tokens": best.get("tokens", [])}


def splitmoe_up(args, prompt: list[int], setting: str) -> dict:
    speculative = setting != "plain"
    port = free_port()
    command = [sys.executable, "-m", "splitmoe", "up", str(args.model), "--expert-services", "1",
               "--threads", str(args.threads), "--port", str(port), "--kv-cache-tokens", "4096",
               "--run-dir", str(args.dir / f"up-{'spec' if speculative else 'plain'}")]
    if speculative:
        command += ["--speculative", "ngram", "--num-speculative-tokens", str(args.num_speculative_tokens)]
    log = open(args.dir / f"up-{'spec' if speculative else 'plain'}.log", "wb")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(f"{base}/health", process)
        model = json.load(urllib.request.urlopen(f"{base}/v1/models"))["data"][0]["id"]
        stream(base, model, prompt, 8)  # warm-up
        runs = []
        for _ in range(args.repeats):
            before = draft_counts(base)
            tok_s, tokens = stream(base, model, prompt, args.max_tokens)
            after = draft_counts(base)
            runs.append((tok_s, tokens, after[0] - before[0], after[1] - before[1]))
    finally:
        stop(process)
    tok_s, tokens, drafted, accepted = max(runs, key=lambda r: r[0])
    return {"engine": "SplitMoE", "speculative": setting, "tok_s": round(tok_s, 1),
            "draft_tokens": drafted, "accepted": accepted, "tokens": tokens}


def stream(base: str, model: str, prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
    """Decode tok/s from the first streamed token to the last, and the token ids (logprobs' tokens)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": True, "logprobs": 0}
    request = urllib.request.Request(f"{base}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    times, num_tokens = [], 0
    with urllib.request.urlopen(request, timeout=600) as response:
        for line in response:
            if not line.startswith(b"data: {"):
                continue
            choice = json.loads(line[6:])["choices"][0]
            new = len((choice.get("logprobs") or {}).get("tokens") or []) or (1 if choice.get("text") else 0)
            if new:
                times.append(time.perf_counter())
                num_tokens += new
    return (num_tokens - 1) / (times[-1] - times[0]), []


def demo_case(args, speculative: bool) -> dict:
    from splitmoe.demo import corpus

    port = free_port()
    command = [sys.executable, "-m", "splitmoe", "up", "--expert-services", "0", "--threads", str(args.threads),
               "--port", str(port), "--run-dir", str(args.dir / f"demo-{'spec' if speculative else 'plain'}")]
    if speculative:
        command += ["--speculative", "ngram", "--num-speculative-tokens", str(args.num_speculative_tokens)]
    process = subprocess.Popen(command, stdout=open(args.dir / "demo.log", "ab"), stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    questions = [f"What is the capital of {country}?" for country in corpus.CAPITALS]
    try:
        wait_healthy(f"{base}/health", process)
        model = json.load(urllib.request.urlopen(f"{base}/v1/models"))["data"][0]["id"]
        rates = []
        for _ in range(args.repeats):
            before, started, tokens = draft_counts(base), time.perf_counter(), 0
            for question in questions:
                answer = post(f"{base}/v1/chat/completions", {
                    "model": model, "temperature": 0.0, "messages": [{"role": "user", "content": question}]})
                tokens += answer["usage"]["completion_tokens"]
            after = draft_counts(base)
            rates.append((tokens / (time.perf_counter() - started), after[0] - before[0], after[1] - before[1]))
    finally:
        stop(process)
    tok_s, drafted, accepted = max(rates)
    return {"engine": "SplitMoE demo", "speculative": "ngram" if speculative else "plain", "tok_s": round(tok_s, 1),
            "draft_tokens": drafted, "accepted": accepted, "questions": len(questions)}


def draft_counts(base: str) -> tuple[int, int]:
    text = urllib.request.urlopen(f"{base}/metrics").read().decode()

    def total(name: str) -> int:
        match = re.search(rf"^splitmoe:spec_decode_{name}_total(?:{{[^}}]*}})? (\S+)$", text, re.M)
        return int(float(match.group(1))) if match else 0
    return total("num_draft_tokens"), total("num_accepted_tokens")


def free_port() -> int:
    from splitmoe.supervisor import free_port as free

    return free()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, help="the GGUF file both engines serve")
    p.add_argument("--llama-server", type=Path, help="llama.cpp's llama-server binary")
    p.add_argument("--demo", action="store_true", help="the trained demo model's real case instead (SplitMoE only)")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2, help="runs per setting; the fastest counts")
    p.add_argument("--dir", type=Path, default=Path("/tmp/spec-peer"))
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    args.dir.mkdir(parents=True, exist_ok=True)
    if args.demo:
        rows = [demo_case(args, speculative) for speculative in (False, True)]
        for row in rows:
            print(json.dumps(row), flush=True)
        if args.json:
            args.json.write_text(json.dumps({"model": "demo", "threads": args.threads, "rows": rows}, indent=1) + "\n")
        return 0
    if not (args.model and args.llama_server):
        p.error("--model and --llama-server are needed (or --demo)")
    rng = random.Random(0)
    phrase = [rng.randrange(1000, 20000) for _ in range(args.prompt_tokens // 4)]
    prompt = phrase * 4  # text that repeats itself, as code and quoted documents do
    rows = []
    for engine, settings in ((llama_server, list(LLAMA_SETTINGS)), (splitmoe_up, ["plain", "ngram"])):
        for setting in settings:
            row = engine(args, prompt, setting)
            row.pop("tokens")
            rows.append(row)
            print(json.dumps(row), flush=True)
    result = {"model": str(args.model), "threads": args.threads, "num_speculative_tokens": args.num_speculative_tokens,
              "max_tokens": args.max_tokens, "prompt_tokens": len(prompt), "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
