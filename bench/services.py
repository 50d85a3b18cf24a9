"""The headline run: real processes (expert services, then the attention service) started with
`splitmoe up`'s building blocks, driven over gRPC with the gateway's own AttentionClient.

Threads: the expert services split `threads` between them and the attention service gets all of
`threads` too, as `splitmoe up` does. Within a step the two sides alternate (the attention side
waits while the experts compute its layer, the expert services wait for the next layer), so at
any moment only one side has work and every core serves it. That only holds if waiting threads
sleep: OpenMP's default lets idle workers spin for a while after each parallel region, which
takes the cores from the other side, so the children get OMP_WAIT_POLICY=PASSIVE by default.
"""
from __future__ import annotations

import asyncio
import dataclasses
import re
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Callable

from splitmoe.bench.driver import (
    SINGLE_END,
    SINGLE_FIRST_TOKEN,
    SINGLE_START,
    STREAMS_END,
    STREAMS_START,
    Measured,
    measure,
)
from splitmoe.bench.workload import Prompts, Workload
from splitmoe.runtime.memory import Resident, resident


@dataclass(frozen=True, slots=True)
class ServicesOptions:
    threads: int
    expert_services: int = 1
    transport: str = "auto"            # the attention service's --transport
    dtype: str = "bfloat16"            # the attention service's --dtype (bfloat16: the fast path)
    attention_device: str = "cpu"      # the attention service's --device: "cpu" or "cuda"
    omp_wait_policy: str = "PASSIVE"   # for every child; "" leaves OpenMP's default
    pin_threads: bool = True           # `splitmoe up`'s thread pinning (its --no-pin-threads: False)
    startup_timeout_s: float = 600.0
    request_timeout_s: float = 3600.0


@dataclass(frozen=True, slots=True)
class ServicesResult:
    measured: Measured
    hop_us: float | None               # None without expert services (nothing crosses a process)
    hop_method: str                    # how hop_us was computed from GetStats
    streams_share: StepShare | None    # where the concurrent streams' steps spent their time; None without
                                       # expert services
    transport: str                     # what the attention service says its expert streams use
    expert_threads: list[int]
    startup_s: float                   # from the first process started to the attention service healthy
    memory: dict[str, Resident]        # each service's memory at the end of the measurements


def run_services(model_path: str, workload: Workload, prompts: Prompts, options: ServicesOptions, run_dir: Path,
                 say: Callable[[str], None]) -> ServicesResult:
    """Start the stack, measure, stop it. Raises ServiceFailed (a service died; its log quoted)
    or KeyboardInterrupt (Ctrl-C, which the supervisor catches while its children run)."""
    from splitmoe.local_stack import UpSettings, split_threads
    from splitmoe.runtime.cluster_auth import ClusterSecurity
    from splitmoe.supervisor import StopRequested, Supervisor

    settings = UpSettings(model_path=model_path, num_expert_services=options.expert_services,
                          threads=options.threads, run_dir=str(run_dir), startup_timeout_s=options.startup_timeout_s,
                          pin_threads=options.pin_threads)
    with Supervisor(run_dir, options.startup_timeout_s, stop_grace_s=10.0, say=lambda line: say("  " + line.strip())) \
            as supervisor:
        try:
            started = time.perf_counter()
            attention_address = _start(supervisor, settings, options, workload)
            startup_s = time.perf_counter() - started
            say(f"    services ready in {startup_s:.0f} s")
            security = ClusterSecurity(token=settings.cluster_token)
            measured, hops, share = asyncio.run(_drive(supervisor, attention_address, security, workload, prompts,
                                                       options, say))
            memory = {c.name: r for c in supervisor.children if (r := resident(c.pid)) is not None}
        except StopRequested:
            raise KeyboardInterrupt from None
    if not options.expert_services:
        transport = "in-process"
    else:
        transport = (hops.transport if hops else "") or expert_transport(run_dir / "attention.log")
    threads = split_threads(options.threads, options.expert_services) if options.expert_services else []
    return ServicesResult(measured, hops.us if hops else None, hops.method if hops else "", share, transport,
                          threads, startup_s, memory)


def _start(supervisor, settings, options: ServicesOptions, workload: Workload) -> str:
    from splitmoe.local_stack import attention_spec, expert_count_of, expert_specs
    from splitmoe.supervisor import free_port

    env = ("env", f"OMP_WAIT_POLICY={options.omp_wait_policy}") if options.omp_wait_policy else ()
    ports = [free_port() for _ in range(options.expert_services)]
    if ports:
        specs = expert_specs(settings, expert_count_of(settings.model_path), ports)
        supervisor.start_stage([dataclasses.replace(s, argv=(*env, *s.argv)) for s in specs])
    attention = attention_spec(settings, free_port(), [f"127.0.0.1:{p}" for p in ports])
    extra = attention_options(options, workload)
    supervisor.start_stage([dataclasses.replace(attention, argv=(*env, *attention.argv, *extra))])
    for child in supervisor.children:  # health is known; an open probe channel would only log the services' exit
        child.probe.close()
    return attention.address


def attention_options(options: ServicesOptions, workload: Workload) -> tuple[str, ...]:
    """`serve-attention`'s options for the benchmark, after those `splitmoe up` gives it."""
    w = workload
    return ("--dtype", options.dtype, "--device", options.attention_device, "--transport", options.transport,
            "--kv-cache-tokens", str(w.kv_tokens()),
            # the whole prompt in one step, and all the streams' prompts in one step
            "--max-batch-tokens", str(max(512, w.prompt_tokens, w.streams * w.stream_prompt_tokens)),
            "--max-running", str(max(64, w.streams)))


async def _drive(supervisor, address: str, security, workload: Workload, prompts: Prompts, options: ServicesOptions,
                 say: Callable[[str], None]) -> tuple[Measured, HopOverhead | None, StepShare | None]:
    from splitmoe.gateway.attention_client import AttentionClient
    from splitmoe.gateway.settings import GatewaySettings
    from splitmoe.proto.attention_pb2_grpc import AttentionServiceStub

    client = AttentionClient(GatewaySettings(attention_address=address, request_timeout_s=options.request_timeout_s,
                                             cluster=security))
    stats_channel = security.aio_channel(address, [("grpc.enable_http_proxy", 0)])
    engine = ServicesEngine(client, AttentionServiceStub(stats_channel))
    work = asyncio.create_task(measure(engine, workload, prompts, say))
    watch = asyncio.create_task(_watch(supervisor))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if watch.done():
            watch.result()  # raises: a service died, or Ctrl-C
        if work.exception() is not None:
            _check_children(supervisor)  # a failed call because a service died: say which
        measured = work.result()
        if not options.expert_services:
            return measured, None, None
        return measured, await engine.hop_overhead(), await engine.streams_step_share()
    finally:
        for task in (work, watch):
            task.cancel()
        await asyncio.gather(work, watch, return_exceptions=True)
        await client.close()
        await stats_channel.close()


async def _watch(supervisor) -> None:
    while True:
        _check_children(supervisor)
        await asyncio.sleep(0.2)


def _check_children(supervisor) -> None:
    from splitmoe.supervisor import ServiceFailed, StopRequested, describe_exit

    if supervisor.num_signals:
        raise StopRequested()
    for child in supervisor.children:
        if (code := child.poll()) is not None:
            raise ServiceFailed(child, f"{describe_exit(code)} during the benchmark")


class ServicesEngine:
    """splitmoe.bench.driver's engine over the AttentionService's Generate stream: one message per token.
    GetStats is called through the generated stub, so fields newer than the gateway's own
    AttentionStats (the transport's per-hop figures) are seen too."""

    def __init__(self, client, stats_stub):
        self.client, self.stats_stub = client, stats_stub
        self._snapshots: dict[str, asyncio.Task] = {}
        self._marked_s: dict[str, float] = {}  # perf_counter when each snapshot was asked for

    async def generate(self, ids: list[int], max_tokens: int) -> AsyncIterator[float]:
        from splitmoe.gateway.attention_types import GenerateParams

        params = GenerateParams(request_id=f"bench-{uuid.uuid4().hex[:12]}", prompt=tuple(ids),
                                sampling={"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True})
        from splitmoe.gateway.attention_client import AttentionError

        count = 0
        try:
            async for chunk in self.client.generate(params):
                arrived_s = time.perf_counter()
                count += 1
                if chunk.usage is not None and chunk.usage.completion_tokens != count:
                    raise RuntimeError(f"{chunk.usage.completion_tokens} tokens in {count} messages: "
                                       f"the stream no longer sends one message per token")
                yield arrived_s
        except AttentionError as e:
            raise RuntimeError(f"attention service: Generate failed ({e.code}): {e.message}") from None

    def mark(self, moment: str) -> None:
        # Snapshots run beside the stream (a task), so reading tokens never waits for them.
        if moment in (SINGLE_START, SINGLE_FIRST_TOKEN, SINGLE_END, STREAMS_START, STREAMS_END):
            from splitmoe.proto import attention_pb2 as pb

            self._marked_s[moment] = time.perf_counter()
            self._snapshots[moment] = asyncio.ensure_future(self.stats_stub.GetStats(pb.AttentionStatsRequest(),
                                                                                     timeout=60.0))

    async def hop_overhead(self) -> "HopOverhead":
        """Over the single stream's decode: from its first token to its end. A short decode on a
        loaded machine can end before the first-token snapshot is answered (no hops in between):
        then from before the stream, its prompt's hops included; and should even that snapshot
        come too late (seen on 2 busy cores), over the concurrent streams' phase."""
        for start, end in ((SINGLE_FIRST_TOKEN, SINGLE_END), (SINGLE_START, SINGLE_END), (STREAMS_START, STREAMS_END)):
            found = hop_overhead(await self._snapshots[start], await self._snapshots[end])
            if found.us is not None:
                break
        return found

    async def streams_step_share(self) -> "StepShare":
        """Over the concurrent streams' phase, from before their requests to after their last
        token: the service is idle at both snapshots, so the counters hold that phase alone."""
        wall_s = self._marked_s[STREAMS_END] - self._marked_s[STREAMS_START]
        return step_share(await self._snapshots[STREAMS_START], await self._snapshots[STREAMS_END], wall_s)


@dataclass(frozen=True, slots=True)
class HopOverhead:
    us: float | None         # per hop; None when no hop happened in between
    method: str
    transport: str           # "" when GetStats does not say


def hop_overhead(before, after) -> HopOverhead:
    """Transport overhead of one hop, in µs, between two GetStats snapshots (proto AttentionStats):
    the round trip (request sent to answer received, as the attention side times it) minus the
    expert compute the service reports for it, over every expert service.

    Where the service reports its own per-hop median (`overhead_us_median`, over its last hops,
    which also leaves out time queued behind the other micro-batch), that is used, weighted by
    each service's hops in between; otherwise the sums give the mean over the hops in between.
    This is the one place that reads the hop fields: a transport that reports more changes only it.
    """
    earlier = {h.expert_address: h for h in before.hops}
    fields = after.DESCRIPTOR.fields_by_name["hops"].message_type.fields_by_name
    hops, overhead_s, weighted_median = 0, 0.0, 0.0
    transports = set()
    for h in after.hops:
        b = earlier.get(h.expert_address)
        n = h.num_hops - (b.num_hops if b else 0)
        hops += n
        overhead_s += h.hop_s_total - h.compute_s_total - ((b.hop_s_total - b.compute_s_total) if b else 0.0)
        if "overhead_us_median" in fields:
            weighted_median += n * h.overhead_us_median
        if "transport" in fields and h.transport:
            transports.add(h.transport)
    transport = "+".join(sorted(transports))
    if not hops:
        return HopOverhead(None, "no hops", transport)
    if weighted_median > 0:
        return HopOverhead(weighted_median / hops, "median per hop as the attention service reports it", transport)
    return HopOverhead(overhead_s / hops * 1e6, "mean per hop: (round trip - expert compute) sums / hops", transport)


@dataclass(frozen=True, slots=True)
class StepShare:
    wall_s: float                      # the phase, as the bench process timed it
    num_steps: int                     # attention-service steps in it
    expert_s: float                    # the busiest expert service's compute in it
    hop_s: float                       # the busiest expert service's hop round trips in it
    outside_experts: float | None      # share of the phase no expert service computed; None: no steps
    outside_hops: float | None         # share of the phase outside every hop: the attention side alone

    @property
    def step_ms(self) -> float | None:
        return 1e3 * self.wall_s / self.num_steps if self.num_steps else None


def step_share(before, after, wall_s: float) -> StepShare:
    """Where the steps between two GetStats snapshots (proto AttentionStats), `wall_s` apart,
    spent their time: the share outside the expert services is

        1 - max over expert services s of (compute_s_total after - before) / wall_s

    A layer call sends one hop to every expert service at once and waits for them all, and one
    service computes its hops one after another, so the hops of a call overlap across services
    and never within one: the busiest service's compute is the time the step waited on expert
    compute with overlapped hops counted once (exact with one expert service; with several it
    is a lower bound of their union, so the share errs high: against a "less than" target, the
    safe side). Everything else is outside: attention, routing, sampling, scheduling and the
    transport (each hop's round trip less its compute). `outside_hops` takes the round trips
    (hop_s_total) instead: what the attention side alone spends, transport excluded. With
    --micro-batches 2 one half's hop can wait behind the other's at a service, so hop_s then
    counts that queueing twice; the bench runs one micro-batch.
    """
    earlier = {h.expert_address: h for h in before.hops}
    expert_s = hop_s = 0.0
    for h in after.hops:
        b = earlier.get(h.expert_address)
        expert_s = max(expert_s, h.compute_s_total - (b.compute_s_total if b else 0.0))
        hop_s = max(hop_s, h.hop_s_total - (b.hop_s_total if b else 0.0))
    num_steps = int(after.num_steps - before.num_steps)
    if not num_steps or wall_s <= 0:
        return StepShare(wall_s, num_steps, expert_s, hop_s, None, None)
    return StepShare(wall_s, num_steps, expert_s, hop_s, 1.0 - expert_s / wall_s, 1.0 - hop_s / wall_s)


_TRANSPORT_LINE = re.compile(r"expert service .* over (\w+)")


def expert_transport(attention_log: Path) -> str:
    """The transports the attention service says it opened its expert streams over, e.g. "shm"
    (older services report none in GetStats)."""
    try:
        text = attention_log.read_text(errors="replace")
    except OSError:
        return "unknown"
    found = sorted(set(_TRANSPORT_LINE.findall(text)))
    return "+".join(found) or "unknown"
