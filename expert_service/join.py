"""`serve-experts --join ATTENTION_ADDR`: this service announces itself to an attention service.

The announcement (AttentionService.JoinExperts, with the cluster secret like every call between
the services) is repeated every `interval_s` while the service runs and is not draining: an
attention service that restarted, or missed the first one, finds the service again. The attention
service does the rest: it health-checks the address, gives it a share of the experts, and only
then sends it hops (attention_service/expert_backends/membership.py).
"""
from __future__ import annotations

import logging
import threading
from typing import Callable

import grpc

from splitmoe.proto import attention_pb2, attention_pb2_grpc
from splitmoe.runtime.cluster_auth import ClusterSecurity

log = logging.getLogger(__name__)


class Announcer:
    """Announces `advertise` (host:port; ':port' lets the attention service use the address it
    sees us calling from) to `attention`, until stopped or draining."""

    def __init__(self, attention: str, advertise: str, instance_id: str, security: ClusterSecurity,
                 draining: Callable[[], bool], interval_s: float = 5.0, timeout_s: float = 5.0):
        self.attention, self.advertise, self.instance_id = attention, advertise, instance_id
        self._security, self._draining = security, draining
        self._interval_s, self._timeout_s = interval_s, timeout_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="expert-join", daemon=True)
        self._last = ""  # the last outcome logged: each change is logged once, not every interval

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def announce_once(self) -> attention_pb2.JoinExpertsResponse:
        with self._security.channel(self.attention) as channel:
            stub = attention_pb2_grpc.AttentionServiceStub(channel)
            return stub.JoinExperts(attention_pb2.JoinExpertsRequest(address=self.advertise,
                                                                     instance_id=self.instance_id),
                                    timeout=self._timeout_s)

    def _run(self) -> None:
        while not self._stop.is_set() and not self._draining():
            try:
                answer = self.announce_once()
                outcome = f"member of {self.attention}" if answer.member else f"{self.attention}: {answer.message}"
            except grpc.RpcError as e:
                outcome = f"cannot join {self.attention} yet: {e.code().name}: {e.details()}"
            if outcome != self._last:
                log.info("%s", outcome)
                self._last = outcome
            self._stop.wait(self._interval_s)
