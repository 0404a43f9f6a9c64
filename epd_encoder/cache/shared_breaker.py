# SPDX-License-Identifier: Apache-2.0
"""A circuit breaker for the shared store: closed, open after consecutive failures, half-open
after a cooldown to let one probe through."""

from __future__ import annotations

import threading
import time
from typing import Callable, Literal

State = Literal["closed", "open", "half_open"]
STATES: tuple[State, ...] = ("closed", "open", "half_open")


class Breaker:
    """``allow()`` before an operation, then exactly one of ``success()`` / ``failure()``
    per allowed operation. Thread-safe.

    Closed: every operation is allowed; ``failures`` consecutive failures open it. Open: none
    is allowed until ``cooldown_s`` has passed; then one probe is (half-open), and its outcome
    closes the breaker or opens it for another cooldown. Other operations wait for that outcome.
    """

    def __init__(self, failures: int, cooldown_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if failures < 1 or cooldown_s <= 0:
            raise ValueError("a breaker needs failures >= 1 and cooldown_s > 0")
        self._threshold, self._cooldown, self._clock = failures, cooldown_s, clock
        self._lock = threading.Lock()
        self._state: State = "closed"
        self._failures = 0
        self._opened_at = 0.0
        self.opened_total = 0

    @property
    def state(self) -> State:
        with self._lock:
            return self._state

    def allow(self) -> bool:
        with self._lock:
            if self._state == "closed":
                return True
            if self._state == "open" and self._clock() - self._opened_at >= self._cooldown:
                self._state = "half_open"  # this caller is the probe
                return True
            return False

    def success(self) -> None:
        with self._lock:
            self._state, self._failures = "closed", 0

    def failure(self) -> None:
        with self._lock:
            self._failures += 1
            if self._state == "half_open" or (self._state == "closed" and self._failures >= self._threshold):
                self._open()

    def _open(self) -> None:
        self._state, self._opened_at = "open", self._clock()
        self.opened_total += 1
