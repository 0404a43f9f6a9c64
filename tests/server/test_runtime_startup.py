# SPDX-License-Identifier: Apache-2.0
"""A ``--tp 2`` runtime that fails to build leaves nothing running: whichever step raises
after the rank group is up (the model record, the preprocessor, the cache, the engine, the
front and its video and fetch set-up, the metrics, the probe encode), every rank has exited,
and the heartbeat and launcher threads have ended, before the error reaches the caller."""

from __future__ import annotations

import sys
import threading
from dataclasses import replace

import psutil
import pytest

import epd_encoder.server.parallel as parallel
import epd_encoder.server.runtime as runtime
from epd_encoder.config import TPConfig
from epd_encoder.models.tiny import write_tiny_model
from epd_encoder.server.runtime import Runtime
from epd_encoder.tp.data import TPExecutor
from tests.e2e.harness import serve_config

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="rank groups need Linux's prctl")

# (module, name) replaced by a callable that raises: each a step between the group's start and
# the end of Runtime.__init__, in build order.
STEPS = [
    (parallel, "LoadedVisionModel"), (parallel, "key_mode"), (runtime, "checkpoint_revision"),
    (runtime, "load_preprocessor"), (runtime, "Metrics"), (runtime, "build_cache"),
    (runtime, "ServingExecutor"), (parallel, "wrap_scheduler"), (runtime, "build_engine"),
    (runtime, "PullStore"), (Runtime, "_fetcher"), (Runtime, "_video"), (runtime, "EncodeFront"),
    (runtime, "Gauge"), ("probe", "encode"),
]


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    base = serve_config(write_tiny_model("qwen2_vl", tmp_path_factory.mktemp("startup") / "m"))
    return replace(base, parallel=TPConfig(tp=2, tp_mode="data"))


def raiser(what: str):
    def fail(*args, **kwargs):
        raise RuntimeError(f"injected at {what}")
    return fail


@pytest.mark.parametrize("owner,name", STEPS, ids=[n for _, n in STEPS])
def test_a_failure_at_any_start_up_step_leaves_no_rank_behind(config, monkeypatch, owner, name):
    started: list[TPExecutor] = []
    real_start = TPExecutor.start

    def start(self):
        started.append(self)
        out = real_start(self)
        if owner == "probe":  # the group is up; the runtime's first encode fails
            self.encode = raiser("probe")
        return out

    monkeypatch.setattr(TPExecutor, "start", start)
    if owner != "probe":
        monkeypatch.setattr(owner, name, raiser(name))
    try:
        with pytest.raises(RuntimeError, match=f"injected at {'probe' if owner == 'probe' else name}"):
            Runtime(config)
        check_nothing_left(started)
    finally:
        for executor in started:  # a leak must not fail the next case too (one process group)
            executor.close()


def check_nothing_left(started: list[TPExecutor]) -> None:
    [executor] = started
    group = executor.group
    assert group.pids and all(code is not None for code in group.exitcodes), group.exitcodes
    children = {p.pid for p in psutil.Process().children(recursive=True)}
    assert not children & set(group.pids), "a rank outlived the failed start"
    names = {t.name for t in threading.enumerate()}
    assert not names & {"tp-heartbeat", "tp-launcher"}, names
