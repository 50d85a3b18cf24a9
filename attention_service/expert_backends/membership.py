"""Which expert services the attention service uses, kept current while it serves.

Three ways the set changes, all found by one thread, one round every `resolve_interval_s`:
- **a name resolves to more or fewer addresses** (compose's `expert` after `--scale`, a Kubernetes
  headless Service after `kubectl scale` or a rescheduled pod, or a line of `--expert-hosts-file`):
  a new address is a candidate; an address missing from its name's answer two rounds in a row is
  leaving (a name that resolves to nothing at all changes nothing: DNS may be down);
- **a service announces itself** (`serve-experts --join`, AttentionService.JoinExperts);
- **a service says it is draining** (SIGTERM: its DescribeShard answers `draining`, which the
  reconnect thread reads every `reconnect_interval_s`).

The round hands its candidates and leavers to `change` (RemoteExperts.change_members), which
health-checks the candidates, gives the services their new share of the experts (loaded before the
placement points at them), switches between two layer calls and only then closes the leavers'
links: a draining service sees its last link close and exits, and no request is lost.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from splitmoe.attention_service.expert_backends.service_client import ExpertServiceClient
from splitmoe.attention_service.expert_backends.services import is_ip, read_hosts_file, resolve_addresses

log = logging.getLogger(__name__)
RETRY_CANDIDATE_S = 2.0  # a candidate that failed its health check is tried again after this
MISSING_ROUNDS = 2       # rounds an address must be missing from its name's answer before it is leaving


@dataclass(frozen=True, slots=True)
class Candidate:
    """A service that may join: where to dial it, and the name its TLS certificate carries."""

    address: str
    server_name: str = ""
    instance_id: str = ""  # as announced (JoinExperts); '' when found by resolving a name


@dataclass(frozen=True, slots=True)
class Change:
    """One round's findings: services to add, members to let go (each with why)."""

    joining: tuple[Candidate, ...]
    leaving: tuple[tuple[ExpertServiceClient, str], ...]

    def __bool__(self) -> bool:
        return bool(self.joining or self.leaving)


class Membership:
    """The thread that finds membership changes and applies them through `change`; see the module
    docstring. `members()`: the services in use now."""

    def __init__(self, addresses: Sequence[str], members: Callable[[], list[ExpertServiceClient]],
                 change: Callable[[Change], None], resolve_interval_s: float, hosts_file: str = "",
                 round_interval_s: float = 1.0):
        # names to resolve again; addresses given as IPs are members or not by their own word only
        self._addresses = [a for a in addresses if not is_ip(a.rpartition(":")[0].strip("[]"))]
        self._members, self._change = members, change
        self._resolve = resolve_interval_s > 0
        self._hosts_file = hosts_file
        self._interval_s = resolve_interval_s if self._resolve else round_interval_s
        self._lock = threading.Lock()
        self._announced: dict[str, Candidate] = {}  # address -> announcement, until it is a member
        self._failed: dict[str, float] = {}          # candidate address -> when its last try failed
        self._missing: dict[str, int] = {}           # member address -> rounds missing from its name
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="expert-membership", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()

    def announce(self, candidate: Candidate) -> tuple[bool, str]:
        """A JoinExperts call: (already a member, what happens next). The round it wakes does the work."""
        for member in self._members():
            if member.address == candidate.address or (candidate.instance_id and
                                                        member.instance_id == candidate.instance_id):
                return member.healthy and not member.draining, f"member as {member.address}"
        with self._lock:
            self._announced[candidate.address] = candidate
            self._failed.pop(candidate.address, None)  # a fresh announcement is tried at once
        self._wake.set()
        return False, f"{candidate.address} is health-checked, then given a share of the experts"

    def find_changes(self) -> Change:
        """One round's candidates and leavers (no I/O but the resolution)."""
        members = self._members()
        known = {m.address for m in members}
        joining: dict[str, Candidate] = {}
        leaving: list[tuple[ExpertServiceClient, str]] = []
        now = time.monotonic()
        with self._lock:
            for address in [a for a in self._announced if a in known]:
                del self._announced[address]
            for candidate in self._announced.values():
                joining[candidate.address] = candidate
        if self._resolve:
            hosts = read_hosts_file(self._hosts_file)
            answers = {name: resolve_addresses([name], hosts) for name in self._addresses}
            for answer in answers.values():
                for address, host in answer:
                    if address not in known and address != host:  # `address != host`: it resolved
                        joining.setdefault(address, Candidate(address, host))
            leaving += self._missing_from(members, answers)
        joining = {a: c for a, c in joining.items() if now - self._failed.get(a, float("-inf")) >= RETRY_CANDIDATE_S}
        for member in members:
            if member.draining and all(member is not m for m, _ in leaving):
                leaving.append((member, "it is draining"))
        return Change(tuple(joining.values()), tuple(leaving))

    def candidate_failed(self, candidate: Candidate, why: str) -> None:
        """Not joined this round (down, another model, draining): tried again after RETRY_CANDIDATE_S."""
        first = candidate.address not in self._failed
        self._failed[candidate.address] = time.monotonic()
        log.log(logging.INFO if first else logging.DEBUG, "expert service %s not joined: %s", candidate.address, why)

    def joined(self, address: str) -> None:
        self._failed.pop(address, None)
        with self._lock:
            self._announced.pop(address, None)

    def _missing_from(self, members: list[ExpertServiceClient],
                      answers: dict[str, list[tuple[str, str]]]) -> list[tuple[ExpertServiceClient, str]]:
        """Members that a name of theirs resolved without, MISSING_ROUNDS rounds in a row."""
        leaving = []
        for member in members:
            for name, answer in answers.items():
                host = name.rpartition(":")[0].strip("[]")
                resolved = [address for address, _ in answer if address != name]
                if member.server_name != host or not resolved or member.address == name:
                    continue
                if member.address in resolved:
                    self._missing.pop(member.address, None)
                    continue
                self._missing[member.address] = rounds = self._missing.get(member.address, 0) + 1
                if rounds >= MISSING_ROUNDS:
                    leaving.append((member, f"{name} no longer resolves to it"))
        return leaving

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                change = self.find_changes()
                if change:
                    self._change(change)
                    for member, _ in change.leaving:
                        self._missing.pop(member.address, None)
            except Exception:  # noqa: BLE001 - one failed round leaves the set as it was; the next tries again
                log.exception("expert membership round failed; the services in use are unchanged")
            self._wake.wait(self._interval_s)
            self._wake.clear()
