# SPDX-License-Identifier: Apache-2.0
"""GET /info and epd_build_info: what the server serves, from a real server on loopback."""

from __future__ import annotations

import os
import sys
import threading
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from epd_encoder import __version__
from epd_encoder.api.schemas import InfoResponse
from epd_encoder.config import LimitsConfig
from epd_encoder.server import cpus
from epd_encoder.server.runtime import Runtime
from epd_encoder.transfer.base import backends
from tests.e2e.harness import Server, metric, scrape, serve_config, wait_for


def test_info_states_the_model_limits_and_features(tiny_dir):
    config = serve_config(tiny_dir, limits=replace(LimitsConfig(), max_items=7), max_body_mb=9)
    s = Server(config).start()
    try:
        with httpx.Client(base_url=s.url, timeout=10) as c:
            r = c.get("/info")
            assert r.status_code == 200, r.text
            info = InfoResponse.model_validate(r.json())
            models = c.get("/v1/models").json()["data"][0]
    finally:
        s.stop()
    rt = s.runtime
    assert info.version == __version__
    assert info.model == models["id"] == "tiny-test" and info.family == models["family"] == "qwen2_5_vl"
    assert info.revision == rt.revision and ":fast" in info.revision  # the tower mode is in the key
    assert (info.dtype, info.device) == ("float32", "cpu")
    assert (info.hidden_size, info.num_deepstack) == (models["hidden_size"], models["num_deepstack"])
    lim = info.limits
    assert (lim.max_items, lim.max_body_bytes) == (7, 9 << 20)
    assert lim.max_image_bytes == config.limits.max_image_bytes
    assert lim.max_video_bytes == config.video.max_video_bytes
    assert lim.max_batch_cost == config.engine.scheduler.max_batch_cost
    assert lim.max_pending_cost == config.engine.max_pending_cost
    f = info.features
    assert f.modalities == ["image", "video"] and f.delivery_modes == ["inline", "pull", "push"]
    assert f.push_backends == list(backends()) and "tcp" in f.push_backends
    assert (f.preprocess_backend, f.tower, f.batch_invariant, f.url_fetch) == ("torchvision", "fast", False, False)


def test_build_info_metric_names_what_is_served(server, client):
    rt = server.runtime
    samples = scrape(client)
    value = metric(samples, "epd_build_info", version=__version__, model="tiny-test", revision=rt.revision,
                   family="qwen2_5_vl", dtype="float32", device="cpu")
    assert value == 1
    assert sum(1 for name, _ in samples if name == "epd_build_info") == 1  # one series, no stale label set


def test_info_and_build_info_wait_for_the_model(tiny_dir):
    gate, entered = threading.Event(), threading.Event()

    def slow_runtime(config, metrics):
        entered.set()
        assert gate.wait(60)
        return Runtime(config, metrics)

    s = Server(serve_config(tiny_dir), make_runtime=slow_runtime).start(wait_ready=False)
    try:
        assert entered.wait(30)
        with httpx.Client(base_url=s.url, timeout=10) as c:
            r = c.get("/info")
            assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"
            assert not any(name == "epd_build_info" for name, _ in scrape(c))
            gate.set()
            assert wait_for(lambda: s.runtime is not None and s.runtime.ready, timeout=60)
            assert c.get("/info").status_code == 200
            assert any(name == "epd_build_info" for name, _ in scrape(c))
    finally:
        gate.set()
        s.stop()


def _serve_pinned(tiny_dir, tmp_path, cpu: int, *argv: str):
    """A real ``epd-encoder serve`` whose affinity mask is ``{cpu}`` from before torch loads."""
    from epd_encoder.bench.server import ServerProcess, free_port

    port = free_port()
    pin = f"import os, sys; os.sched_setaffinity(0, {{{cpu}}}); from epd_encoder.cli import main; sys.exit(main())"
    cmd = [sys.executable, "-c", pin, "serve", "--model", str(tiny_dir), "--port", str(port), *argv]
    return ServerProcess(cmd, port, tmp_path / f"serve-{port}.log", start_timeout=180)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs an affinity mask of 2+ CPUs to restrict")
def test_a_server_sizes_its_threads_from_its_affinity_and_threads_overrides_it(tiny_dir, tmp_path):
    cpu = min(os.sched_getaffinity(0))
    pinned, forced = _serve_pinned(tiny_dir, tmp_path, cpu), _serve_pinned(tiny_dir, tmp_path, cpu, "--threads", "3")
    with pinned, forced:
        got = {name: httpx.get(f"{s.url}/info", timeout=30).json()["cpus"]
               for name, s in (("pinned", pinned), ("forced", forced))}
        logs = {name: s.tail(100_000) for name, s in (("pinned", pinned), ("forced", forced))}
    assert got["pinned"]["affinity"] == 1 and got["pinned"]["threads"] == 1, got
    assert got["pinned"]["source"] == "affinity" and got["pinned"]["preprocess_workers"] == 1, got
    assert got["pinned"]["host"] == os.cpu_count()  # torch's default would have taken all of these
    assert (got["forced"]["threads"], got["forced"]["source"], got["forced"]["affinity"]) == (3, "--threads", 1), got
    # One INFO line at start says what was chosen and why; the CLI set the wait policy before torch loaded.
    assert "CPU budget: 1 intra-op threads (affinity; affinity 1 CPUs" in logs["pinned"], logs["pinned"][-3000:]
    assert "CPU budget: 3 intra-op threads (--threads;" in logs["forced"], logs["forced"][-3000:]
    if "GOMP_SPINCOUNT" not in os.environ and "OMP_WAIT_POLICY" not in os.environ:
        assert got["pinned"]["wait_policy"] == f"default (GOMP_SPINCOUNT={cpus.DEFAULT_SPINCOUNT})", got


@pytest.fixture
def one_core_cgroup():
    """A real cgroup limited to one core's quota (v2 cpu.max or v1 cfs): the file a process
    writes its pid to, to join it. Skips where cgroups cannot be made (not root, read-only)."""
    made = None
    try:
        v2, v1 = Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/cpu")
        name = f"epd-test-{os.getpid()}"
        if (v2 / "cgroup.controllers").is_file() and "cpu" in (v2 / "cgroup.subtree_control").read_text().split():
            made = v2 / name
            made.mkdir()
            (made / "cpu.max").write_text("100000 100000")
        elif (v1 / "cpu.cfs_quota_us").is_file():
            made = v1 / name
            made.mkdir()
            (made / "cpu.cfs_period_us").write_text("100000")
            (made / "cpu.cfs_quota_us").write_text("100000")
        else:
            pytest.skip("no writable cgroup cpu controller")
    except OSError as e:
        if made is not None and made.exists():
            made.rmdir()
        pytest.skip(f"cannot make a cgroup here: {e}")
    yield made / "cgroup.procs"
    for _ in range(100):  # its processes have exited; the kernel frees the group a moment later
        try:
            made.rmdir()
            return
        except OSError:
            threading.Event().wait(0.1)


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs 2+ CPUs, so a one-core quota is smaller than the affinity mask")
def test_a_server_in_a_one_core_cgroup_runs_one_intra_op_thread(tiny_dir, tmp_path, one_core_cgroup):
    from epd_encoder.bench.server import ServerProcess, free_port

    port = free_port()
    join = f"import sys; open({str(one_core_cgroup)!r}, 'w').write('0'); from epd_encoder.cli import main; sys.exit(main())"
    cmd = [sys.executable, "-c", join, "serve", "--model", str(tiny_dir), "--port", str(port)]
    with ServerProcess(cmd, port, tmp_path / "serve.log", start_timeout=180) as s:
        got = httpx.get(f"{s.url}/info", timeout=30).json()["cpus"]
    assert got["quota"] == 1.0 and got["affinity"] == len(os.sched_getaffinity(0)), got
    assert got["threads"] == 1 and got["source"].startswith("cgroup v"), got


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs sched_setaffinity")
def test_tp_ranks_split_the_threads_budget(tiny_dir, tmp_path):
    cpu = min(os.sched_getaffinity(0))
    # Pinned to one CPU, the ranks would get 1 thread each from the mask; --threads 4 gives them 2.
    with _serve_pinned(tiny_dir, tmp_path, cpu, "--threads", "4", "--tp", "2", "--tp-mode", "data") as s:
        got = httpx.get(f"{s.url}/info", timeout=30).json()
        log = s.tail(100_000)
    assert (got["cpus"]["threads"], got["features"]["tp"]) == (4, 2), got
    assert "tensor-parallel group of 2 up" in log and "2 threads each" in log, log[-3000:]
