# SPDX-License-Identifier: Apache-2.0
import pytest

from epd_encoder.cache.shared_breaker import Breaker


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_consecutive_failures_open_it_and_a_success_resets_the_count():
    b = Breaker(3, 10.0, Clock())
    for _ in range(2):
        assert b.allow()
        b.failure()
    b.success()  # not consecutive any more
    for _ in range(2):
        b.failure()
    assert b.state == "closed" and b.allow()
    b.failure()
    assert b.state == "open" and not b.allow() and b.opened_total == 1


def test_after_the_cooldown_exactly_one_probe_goes_and_its_success_closes_it():
    clock = Clock()
    b = Breaker(1, 5.0, clock)
    b.failure()
    clock.now = 4.9
    assert not b.allow()
    clock.now = 5.0
    assert b.allow() and b.state == "half_open"
    assert not b.allow()  # the others wait for the probe
    b.success()
    assert b.state == "closed" and b.allow()


def test_a_failed_probe_opens_it_for_another_cooldown():
    clock = Clock()
    b = Breaker(2, 5.0, clock)
    b.failure()
    b.failure()
    clock.now = 5.0
    assert b.allow()
    b.failure()  # one failed probe is enough, whatever the threshold
    assert b.state == "open" and b.opened_total == 2
    clock.now = 9.9
    assert not b.allow()
    clock.now = 10.0
    assert b.allow()


@pytest.mark.parametrize("args", [(0, 1.0), (1, 0.0)])
def test_nonsense_settings_are_refused(args):
    with pytest.raises(ValueError):
        Breaker(*args)
