"""Expert services scaled while serving, soaked: `--streams` streams decode without pause while the
number of expert services follows `--counts` (default 1, 4, 1, 3), then `--step-s` seconds
of decoding (the counts repeat, `--duration-s` / `--step-s` steps).

    python -m splitmoe.bench.membership_soak --dir /tmp/soak [--model FILE] [--duration-s 300]

Real processes, as `splitmoe up` runs them: an attention service (float32, so that a temperature-0
output is the same whatever the placement: a changed token is a corrupted response) and expert
services on loopback addresses 127.0.0.2, 127.0.0.3, ... sharing one port, behind one name that
the attention service resolves through its `--expert-hosts-file` (as compose's DNS answers
`expert`). Scaling up starts `--unassigned` services and adds their lines; scaling down sends the
newest ones SIGTERM (they drain) and removes their lines once they have exited. Reported: requests
answered, failed and corrupted, per step the services and the hops each took during it (every
newcomer must take work), and how long the drains took. JSON with `--json`.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

PROMPT_TOKENS = 12
MAX_TOKENS = 24


def spawn(args: list[str], log: Path, token: str) -> subprocess.Popen:
    from splitmoe.runtime.settings import CLUSTER_TOKEN_ENV

    env = {**os.environ, CLUSTER_TOKEN_ENV: token, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "splitmoe", *args], stdout=open(log, "wb"),
                            stderr=subprocess.STDOUT, env=env)


def wait_serving(address: str, proc: subprocess.Popen, timeout_s: float = 120.0) -> None:
    from splitmoe.supervisor import GrpcHealthProbe

    probe = GrpcHealthProbe(address)
    try:
        deadline_s = time.monotonic() + timeout_s
        while not probe.check(1.0):
            if proc.poll() is not None:
                raise RuntimeError(f"{address} exited with {proc.returncode}")
            if time.monotonic() >= deadline_s:
                raise TimeoutError(f"{address} not serving after {timeout_s} s")
            time.sleep(0.1)
    finally:
        probe.close()


class Experts:
    """Expert services on 127.0.0.N:port, listed in a hosts file under one name."""

    def __init__(self, model: Path, port: int, hosts_file: Path, log_dir: Path, token: str, threads: int):
        self.model, self.port, self.hosts_file, self.log_dir, self.token = model, port, hosts_file, log_dir, token
        self.threads = threads
        self.running: dict[str, subprocess.Popen] = {}  # ip -> process, oldest first
        self._next_ip = (f"127.0.0.{n}" for n in itertools.count(2))
        self.drain_s: list[float] = []

    def scale(self, count: int) -> None:
        while len(self.running) < count:
            ip = next(self._next_ip)
            args = ["serve-experts", str(self.model), "--host", ip, "--port", str(self.port), "--threads",
                    str(self.threads), "--unassigned"]
            proc = spawn(args, self.log_dir / f"expert-{ip}.log", self.token)
            wait_serving(f"{ip}:{self.port}", proc)
            self.running[ip] = proc
            self._write()
        leaving = list(self.running)[count:][::-1]
        started_s = time.monotonic()
        for ip in leaving:
            self.running[ip].send_signal(signal.SIGTERM)
        for ip in leaving:
            if self.running[ip].wait(timeout=120) != 0:
                raise RuntimeError(f"expert service {ip} exited with {self.running[ip].returncode}")
            self.drain_s.append(time.monotonic() - started_s)
            del self.running[ip]
        self._write()

    def _write(self) -> None:
        self.hosts_file.write_text("".join(f"{ip} experts\n" for ip in self.running))

    def stop(self) -> None:
        for proc in self.running.values():
            proc.kill()
            proc.wait()


def generate(stub, ids: list[int]) -> list[int]:
    from splitmoe.proto import attention_pb2 as pb

    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    return [t.token_id for r in stub.Generate(request, timeout=120) for t in r.tokens]


def hops(stub) -> dict[str, int]:
    from splitmoe.proto import attention_pb2 as pb

    return {h.expert_address.split(":")[0]: h.num_hops for h in stub.GetStats(pb.AttentionStatsRequest(), timeout=30).hops}


def soak(args) -> dict:
    import grpc
    import torch

    from splitmoe.demo_model import demo_model_path
    from splitmoe.proto import attention_pb2_grpc
    from splitmoe.runtime.cluster_auth import ClusterSecurity
    from splitmoe.supervisor import free_port

    args.dir.mkdir(parents=True, exist_ok=True)
    model = args.model or demo_model_path()
    token = "soak-cluster-secret-" + os.urandom(8).hex()
    port, attention_port = free_port(), free_port()
    hosts = args.dir / "hosts"
    experts = Experts(model, port, hosts, args.dir, token, args.expert_threads)
    attention = None
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 200, (PROMPT_TOKENS,), generator=gen).tolist() for _ in range(args.streams)]
    try:
        experts.scale(args.counts[0])
        attention = spawn(["serve-attention", str(model), "--port", str(attention_port), "--dtype", "float32",
                           "--expert-services", f"experts:{port}", "--expert-hosts-file", str(hosts),
                           "--max-running", str(args.streams), "--threads", str(args.threads)],
                          args.dir / "attention.log", token)
        wait_serving(f"127.0.0.1:{attention_port}", attention, 300)
        channel = ClusterSecurity(token=token).channel(f"127.0.0.1:{attention_port}")
        stub = attention_pb2_grpc.AttentionServiceStub(channel)
        with ThreadPoolExecutor(args.streams) as pool:
            expected = list(pool.map(lambda ids: generate(stub, ids), prompts))
        results = {"answered": 0, "failed": 0, "corrupted": 0, "errors": []}
        stop = threading.Event()
        lock = threading.Lock()

        def stream(i: int) -> None:
            while not stop.is_set():
                try:
                    ok = generate(stub, prompts[i]) == expected[i]
                    with lock:
                        results["answered"] += 1
                        results["corrupted"] += not ok
                except grpc.RpcError as e:
                    with lock:
                        results["failed"] += 1
                        results["errors"].append(f"{e.code().name}: {e.details()}"[:300])

        steps = []
        threads = [threading.Thread(target=stream, args=(i,)) for i in range(args.streams)]
        for t in threads:
            t.start()
        start_s = time.monotonic()
        try:
            for count in itertools.islice(itertools.cycle(args.counts), max(1, round(args.duration_s / args.step_s))):
                step_start_s = time.monotonic()
                experts.scale(count)  # started (serving) or drained and gone: the step counts from here
                before = hops(stub)
                answered = results["answered"]
                time.sleep(args.step_s)
                after = hops(stub)
                steps.append({"services": count, "at_s": round(step_start_s - start_s, 1),
                              # every running service, 0 for one that was never given work
                              "hops_by_service": {ip: after.get(ip, 0) - before.get(ip, 0) for ip in experts.running},
                              "answered": results["answered"] - answered})
                print(json.dumps(steps[-1]), flush=True)
        finally:
            stop.set()
            for t in threads:
                t.join()
        wall_s = time.monotonic() - start_s
        return {"model": str(model), "streams": args.streams, "counts": args.counts, "step_s": args.step_s,
                "wall_s": round(wall_s, 1), "answered": results["answered"], "failed": results["failed"],
                "corrupted": results["corrupted"], "errors": results["errors"][:5], "steps": steps,
                "drain_s": [round(s, 2) for s in experts.drain_s],
                "every_newcomer_took_work": all(all(n > 0 for n in s["hops_by_service"].values()) for s in steps)}
    finally:
        if attention is not None:
            attention.send_signal(signal.SIGTERM)
            attention.wait(60)
        experts.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m splitmoe.bench.membership_soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", type=Path, required=True, help="logs, the hosts file")
    p.add_argument("--model", type=Path, default=None, help="GGUF file (default: the demo model's shape, random weights)")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--counts", type=lambda t: [int(x) for x in t.split(",")], default=[1, 4, 1, 3],
                   help="expert services per step, repeated (default 1,4,1,3)")
    p.add_argument("--step-s", type=float, default=30.0)
    p.add_argument("--duration-s", type=float, default=300.0)
    p.add_argument("--threads", type=int, default=1, help="the attention service's threads")
    p.add_argument("--expert-threads", type=int, default=1)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    report = soak(args)
    text = json.dumps(report, indent=1)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")
    return 0 if not report["failed"] and not report["corrupted"] and report["every_newcomer_took_work"] else 1


if __name__ == "__main__":
    sys.exit(main())
