"""Per-hop cost of the attention -> expert transports: `python -m splitmoe.bench.transport_bench` (< 30 s).

One expert service process with a trivial expert (the output is the input: no compute) and one
client process, over loopback: for each transport (grpc: tensors as bytes in the Forward
stream's messages; shm: shared-memory slots and the Unix-socket doorbell) and each hop size
(1, 16, 512 tokens of hidden 2048, float32, top-8 routing), the median round trip of
`ExpertServiceClient.submit` + `wait`, as the attention service pays it, and the Python heap
allocated per hop (tracemalloc: protobuf bytes count, tensors allocated by torch do not).

`--baseline REV` measures the same through the code of a git revision too (`git archive` into a
temporary directory), in the same run: the old path beside the new one.

`--pipeline MODEL.gguf` measures instead what micro-batches gain: decode steps of `--seqs`
sequences against real expert service processes, one step as a whole (micro_batches=1) and the
next as two pipelined halves (micro_batches=2), alternating, so that drift hits both alike.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import splitmoe  # noqa: F401 - first: the runtimes' defaults, before torch loads (splitmoe/__init__.py)

REPO = Path(__file__).resolve().parents[1]
HIDDEN = 2048
TOP_K = 8
TOKENS = (1, 16, 512)
TRANSPORTS = ("grpc", "shm")


# ---- the expert service side --------------------------------------------------------------------

class _StubFile:
    file_id = "transport-bench"
    arch = "bench"
    path = Path("transport-bench.gguf")

    def get(self, key, default=None):
        return default


class TrivialShard:
    """HostedShard's interface with no experts behind it: forward returns its input."""

    hidden_size = HIDDEN
    g = _StubFile()
    native_hops = None  # no C++ hop loop: every doorbell hop goes through Python

    def describe(self):
        from splitmoe.expert_service.shard import ShardDescription

        return ShardDescription((0,), tuple(range(TOP_K)), 0)

    def load(self, layers, experts):
        return self.describe()

    def forward(self, layer, hidden, expert_ids, expert_weights):
        return hidden, 0.0

    def token_counts(self):
        return {}

    def totals(self):
        from splitmoe.expert_service.shard import ShardTotals

        return ShardTotals(0, 0.0)


def serve() -> None:
    import torch

    from splitmoe.expert_service.server import ExpertServer
    from splitmoe.expert_service.settings import ExpertServiceSettings

    torch.set_num_threads(1)
    server = ExpertServer(ExpertServiceSettings(Path("transport-bench.gguf"), port=0), TrivialShard())
    print(server.start(), flush=True)
    sys.stdin.read()  # until the parent closes our stdin
    server.stop()


# ---- the attention side ---------------------------------------------------------------------------

class Cells:
    """The client process's connections (one per transport) and hop inputs (one per size)."""

    def __init__(self, address: str):
        import torch

        from splitmoe.attention_service.expert_backends.service_client import ConnectionSettings, ExpertServiceClient

        torch.set_num_threads(1)
        self.clients = {}
        for transport in TRANSPORTS:
            client = ExpertServiceClient(address, ConnectionSettings(connect_timeout_s=2.0, transport=transport))
            client.open_stream(client.describe(30.0, wait_for_ready=True))
            self.clients[transport] = client
        self.inputs = {}
        for num_tokens in TOKENS:
            gen = torch.Generator().manual_seed(num_tokens)
            self.inputs[num_tokens] = (torch.randn(num_tokens, HIDDEN, generator=gen),
                                       torch.randint(0, TOP_K, (num_tokens, TOP_K), generator=gen, dtype=torch.int32),
                                       torch.rand(num_tokens, TOP_K, generator=gen))
        self.warm: set[tuple[str, int]] = set()

    def hop(self, transport: str, num_tokens: int) -> None:
        hidden, ids, weights = self.inputs[num_tokens]
        client = self.clients[transport]
        client.wait(client.submit(0, hidden, None, ids, weights))

    def measure(self, transport: str, num_tokens: int, budget_s: float) -> dict:
        """One burst of hops: median round trip (µs), hops, the overhead GetStats would report for
        them (µs; None in code that has no such figure), Python heap of one hop (KiB, tracemalloc)."""
        import tracemalloc

        client = self.clients[transport]
        if (transport, num_tokens) not in self.warm:
            for _ in range(10):
                self.hop(transport, num_tokens)
            self.warm.add((transport, num_tokens))
        if hasattr(client.counters, "recent_overhead_s"):  # this burst's hops only
            del client.counters.recent_overhead_s[:]
        times_s = []
        deadline_s = time.perf_counter() + budget_s
        while len(times_s) < 3 or (time.perf_counter() < deadline_s and len(times_s) < 5000):
            start_s = time.perf_counter()
            self.hop(transport, num_tokens)
            times_s.append(time.perf_counter() - start_s)
        counters = client.counters  # older code has no overhead figure
        overhead_us = counters.overhead_us_median() if hasattr(counters, "overhead_us_median") else None
        tracemalloc.start()
        self.hop(transport, num_tokens)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        return {"us": statistics.median(times_s) * 1e6, "hops": len(times_s), "overhead_us": overhead_us,
                "py_kib": peak / 1024, "transport": client.transport}

    def close(self) -> None:
        for client in self.clients.values():
            client.close()


def serve_cells() -> None:
    """The client process: connect when told the address, then one burst per request line."""
    cells = Cells(sys.stdin.readline().strip())
    try:
        print("ready", flush=True)
        for line in sys.stdin:
            transport, num_tokens, budget_s = line.split()
            print(json.dumps(cells.measure(transport, int(num_tokens), float(budget_s))), flush=True)
    finally:
        cells.close()


# ---- micro-batches ---------------------------------------------------------------------------------

class _TimedWaits:
    """An ExpertBackend passing through, adding up the time the caller blocks on expert results."""

    def __init__(self, inner):
        self.inner, self.waited_s = inner, 0.0

    def forward(self, *call):
        return self.submit(*call).wait()

    def submit(self, *call):
        handle, timed = self.inner.submit(*call), self

        class Handle:
            def wait(self):
                start_s = time.perf_counter()
                try:
                    return handle.wait()
                finally:
                    timed.waited_s += time.perf_counter() - start_s
        return Handle()

    def __getattr__(self, name):
        return getattr(self.inner, name)


def pipeline_gain(model: Path, num_seqs: int, num_steps: int, dtype: str, threads: int, num_services: int,
                  transport: str) -> None:
    import torch

    from splitmoe.attention_service.expert_backends.remote import RemoteExperts, RemoteExpertsSettings
    from splitmoe.attention_service.model.runner import DTYPES, ModelRunner, RunnerOptions
    from splitmoe.attention_service.model.sequence import Sequence
    from splitmoe.modelfile.gguf_file import GGUFFile
    from tests.support.expert_services import ExpertServices
    from tests.support.processes import CLUSTER

    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory(prefix="splitmoe-pipeline-") as logs:
        services = ExpertServices(Path(logs))
        g = GGUFFile(model)
        try:
            for i in range(num_services):
                services.start(f"experts{i}", model, "--unassigned", "--threads", str(threads))
            services.wait(300)
            addresses = tuple(services.address(f"experts{i}") for i in range(num_services))
            settings = RemoteExpertsSettings(addresses=addresses, transport=transport, expert_timeout_s=120, security=CLUSTER)
            with RemoteExperts(g, settings) as experts:
                options = RunnerOptions(dtype=DTYPES[dtype], device=torch.device("cpu"), kv_cache_tokens=64 * num_seqs,
                                        micro_batches=2)
                timed = _TimedWaits(experts)
                runner = ModelRunner.from_gguf(g, options, experts=timed)
                gen = torch.Generator().manual_seed(0)
                seqs = [Sequence(i, torch.randint(0, runner.cfg.vocab_size, (8,), generator=gen).tolist())
                        for i in range(num_seqs)]
                logits = runner.step(seqs)
                times_s: dict[int, list[float]] = {1: [], 2: []}
                waits_s: dict[int, list[float]] = {1: [], 2: []}
                for step in range(2 + 2 * num_steps):  # two warm-up steps, then alternating
                    micro_batches = 1 + step % 2
                    runner.model.micro_batches = micro_batches
                    for seq, row in zip(seqs, logits):
                        seq.token_ids.append(int(row.argmax()))
                    start_s, timed.waited_s = time.perf_counter(), 0.0
                    logits = runner.step(seqs)
                    if step >= 2:
                        times_s[micro_batches].append(time.perf_counter() - start_s)
                        waits_s[micro_batches].append(timed.waited_s)
                hops = experts.stats()
        finally:
            services.stop_all()
    one, two = (statistics.median(times_s[m]) * 1e3 for m in (1, 2))
    print(f"decode step, {num_seqs} sequences, {model.name}, {dtype}, {threads} thread(s) per process, "
          f"{num_services} expert service(s) over {transport}, median of {num_steps} steps each:")
    print("| micro-batches | ms/step | tokens/s | blocked on experts, ms | the rest (attention side), ms |")
    print("| --- | --- | --- | --- | --- |")
    for m, name, ms in ((1, "1 (unsplit)", one), (2, "2 (pipelined)", two)):
        waited = statistics.median(waits_s[m]) * 1e3
        print(f"| {name} | {ms:.1f} | {num_seqs / ms * 1e3:.1f} | {waited:.1f} | {ms - waited:.1f} |")
    print(f"gain: {one / two:.2f}x ({(two - one) / one:+.0%} step time)")
    for address, h in hops.items():
        print(f"{address}: {h.num_hops} hops over {h.transport}, overhead median {h.overhead_us_median:.0f} µs, "
              f"compute {h.compute_s_total / max(h.num_hops, 1) * 1e3:.2f} ms/hop")


# ---- the driver -----------------------------------------------------------------------------------

def _run_trees(trees: dict[str, Path], budget_s: float, rounds: int) -> dict[str, dict[str, dict]]:
    """A server and a client process per tree, importing that tree's code; all start together
    (importing torch is most of the run). Then rounds of short bursts, the trees taking turns
    cell by cell, so that the machine's load drifts over all of them alike; per cell the median
    over the rounds."""
    procs = []
    try:
        clients = {}
        for name, tree in trees.items():
            env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONWARNINGS": "ignore"}
            script = [sys.executable, str(Path(__file__).resolve()), "--tree", str(tree)]
            server = subprocess.Popen([*script, "--role", "server"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      text=True, env=env, cwd=tree)
            client = subprocess.Popen([*script, "--role", "client"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      text=True, env=env, cwd=tree)
            procs += [server, client]
            clients[name] = (server, client)
        for name, (server, client) in clients.items():
            client.stdin.write(f"127.0.0.1:{server.stdout.readline().strip()}\n")
            client.stdin.flush()
        for name, (_, client) in clients.items():
            if client.stdout.readline().strip() != "ready":
                raise RuntimeError(f"{name}: the client failed (exit {client.wait()})")
        bursts: dict[tuple, list[dict]] = {}
        for _ in range(rounds):
            for transport in TRANSPORTS:
                for num_tokens in TOKENS:
                    for name, (_, client) in clients.items():
                        client.stdin.write(f"{transport} {num_tokens} {budget_s}\n")
                        client.stdin.flush()
                        bursts.setdefault((name, transport, num_tokens), []).append(json.loads(client.stdout.readline()))
        results: dict[str, dict[str, dict]] = {}
        for (name, transport, num_tokens), runs in bursts.items():
            overheads = [r["overhead_us"] for r in runs if r["overhead_us"] is not None]
            results.setdefault(name, {}).setdefault(transport, {})[str(num_tokens)] = {
                "us": statistics.median(r["us"] for r in runs), "hops": sum(r["hops"] for r in runs),
                "overhead_us": statistics.median(overheads) if overheads else None,
                "py_kib": statistics.median(r["py_kib"] for r in runs), "transport": runs[-1]["transport"]}
        return results
    finally:
        for proc in procs:
            proc.stdin.close()
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


def socket_floor_us(budget_s: float = 0.5) -> float:
    """What any Python doorbell costs here: two wake-ups and four system calls, nothing else."""
    import socket

    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid == 0:  # echo until the parent hangs up
        parent.close()
        buf = bytearray(64)
        while n := child.recv_into(buf):
            child.send(memoryview(buf)[:n])
        os._exit(0)
    child.close()
    message, buf, times_s = bytes(32), bytearray(64), []
    deadline_s = time.perf_counter() + budget_s
    while time.perf_counter() < deadline_s:
        start_s = time.perf_counter()
        parent.send(message)
        parent.recv_into(buf)
        times_s.append(time.perf_counter() - start_s)
    parent.close()
    os.waitpid(pid, 0)
    return statistics.median(times_s[len(times_s) // 10:]) * 1e6


def _export(rev: str, into: Path) -> Path:
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def table(runs: dict[str, dict[str, dict]]) -> str:
    new = list(runs)[-1]
    head = ("| transport | tokens |" + "".join(f" {name}: µs/hop |" for name in runs)
            + f" {new}: overhead µs (GetStats) |" + "".join(f" {name}: Python KiB/hop |" for name in runs))
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for transport in TRANSPORTS:
        for num_tokens in map(str, TOKENS):
            cells = [runs[name][transport][num_tokens] for name in runs]
            overhead = runs[new][transport][num_tokens]["overhead_us"]
            lines.append(f"| {transport} | {num_tokens} |" + "".join(f" {c['us']:,.0f} |" for c in cells)
                         + f" {'-' if overhead is None else f'{overhead:,.0f}'} |"
                         + "".join(f" {c['py_kib']:,.0f} |" for c in cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", metavar="REV", help="also measure this git revision's code (the old path)")
    p.add_argument("--budget-s", type=float, default=0.1, help="seconds of hops per cell and round")
    p.add_argument("--rounds", type=int, default=7, help="rounds of bursts; per cell the median over them")
    p.add_argument("--pipeline", metavar="MODEL", type=Path, help="measure micro-batches' gain on this GGUF instead")
    p.add_argument("--seqs", type=int, default=16, help="--pipeline: sequences per decode step")
    p.add_argument("--steps", type=int, default=10, help="--pipeline: timed steps per setting")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="--pipeline: attention dtype")
    p.add_argument("--threads", type=int, default=1, help="--pipeline: torch threads per process")
    p.add_argument("--services", type=int, default=1, help="--pipeline: expert service processes")
    p.add_argument("--transport", default="auto", choices=["auto", "grpc", "shm"], help="--pipeline: transport")
    p.add_argument("--role", choices=["server", "client"], help=argparse.SUPPRESS)
    p.add_argument("--tree", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.role == "server":
        serve()
        return 0
    if args.role == "client":
        serve_cells()
        return 0
    if args.pipeline:
        pipeline_gain(args.pipeline, args.seqs, args.steps, args.dtype, args.threads, args.services, args.transport)
        return 0
    start_s = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="splitmoe-baseline-") as tmp:
        trees = {args.baseline: _export(args.baseline, Path(tmp))} if args.baseline else {}
        runs = _run_trees({**trees, "this tree": REPO}, args.budget_s, args.rounds)
    print(f"hop round trip, hidden {HIDDEN} float32, top-{TOP_K}, trivial expert; loopback, one host; median of "
          f"{args.rounds} rounds of {args.budget_s:g} s bursts, the code versions taking turns")
    print(table(runs))
    print(f"floor: a bare 32-byte Unix-socket ping-pong between two Python processes: {socket_floor_us():.0f} µs")
    print(f"({time.perf_counter() - start_s:.0f} s)")
    return 0


if __name__ == "__main__":
    if "--tree" in sys.argv:  # a server or client process: import that tree's code, not ours
        sys.path.insert(0, sys.argv[sys.argv.index("--tree") + 1])
        here = str(Path(__file__).resolve().parent)
        if here in sys.path:
            sys.path.remove(here)
    raise SystemExit(main())
