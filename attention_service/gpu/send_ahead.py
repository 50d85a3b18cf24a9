"""Layer calls finished by a thread of their own, so that the engine thread keeps the GPU busy.

With two micro-batches (`--micro-batches 2`) a GPU should compute one half's attention while the
CPU experts compute the other half's layer. On the engine thread alone it cannot: a layer call
waits for its rows to reach the host (the copy after that half's attention) before it sends
them, and only then can the engine queue the next half's kernels. Here the engine thread only
queues the copy and hands the call over; this thread waits for the copy and sends (or, for
experts in this process, computes), while the engine thread goes on to queue the other half's
attention, and the copies of one half run beside the other half's kernels.

One thread, calls in the order given: each expert service answers its hops in order.
"""
from __future__ import annotations

import queue
import threading
from typing import Callable

import torch

_STOP = object()


class Later:
    """A layer call this thread will start; `wait()` gives the started call's answer."""

    __slots__ = ("_start", "_started", "_handle", "_error")

    def __init__(self, start: Callable[[], object]):
        self._start = start
        self._started = threading.Event()
        self._handle = None
        self._error: BaseException | None = None

    def run(self) -> None:
        try:
            self._handle = self._start()
        except BaseException as e:  # noqa: BLE001 - handed to the waiter
            self._error = e
        finally:
            self._started.set()

    def wait(self) -> torch.Tensor:
        self._started.wait()
        if self._error is not None:
            raise self._error
        return self._handle.wait()


class SendAhead:
    """The thread (started at the first call) and its queue of layer calls to start."""

    def __init__(self, name: str = "hop-send-ahead"):
        self._name = name
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, start: Callable[[], object]) -> Later:
        """`start()` runs on this thread, after every call submitted before it."""
        later = Later(start)
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
        self._calls.put(later)
        return later

    def close(self) -> None:
        with self._lock:
            if self._thread is not None:
                self._calls.put(_STOP)
                self._thread.join(timeout=10)
                self._thread = None

    def _run(self) -> None:
        # The calls are part of the engine's forward, which runs in inference mode: a thread's mode
        # is its own, and the tensors a call writes in place (lent buffers) are inference tensors.
        with torch.inference_mode():
            while (later := self._calls.get()) is not _STOP:
                later.run()
