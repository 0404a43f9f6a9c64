# SPDX-License-Identifier: Apache-2.0
"""The README's promises: it opens with exactly two commands, and its curl example works
with a real photo against a real `epd-encoder serve` process."""

from __future__ import annotations

import io
import json
import pathlib
import re
import shutil
import socket
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest
from PIL import Image

from epd_encoder.models.tiny import write_tiny_model

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
EPD = pathlib.Path(sys.executable).parent / "epd-encoder"


def code_blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def test_readme_starts_with_exactly_two_commands():
    head = README.split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", head, flags=re.S)
    assert [b.split("#")[0].strip() for b in blocks] == ["make serve", "make test"]
    assert head.index("make serve") < head.index("epd-encoder is the")


def curl_block() -> str:
    (block,) = [b for b in code_blocks("bash") if "--data-binary @-" in b]
    return block


def photo(path: pathlib.Path, target: int = 1 << 20) -> int:
    """A photo-like JPEG of about ``target`` bytes: smooth gradients plus sensor-like noise."""
    h, w = 1200, 1600
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    rgb = np.stack([128 + 100 * np.sin(x / 97), 128 + 100 * np.cos(y / 61), 128 + 60 * np.sin((x + y) / 41)], -1)
    rgb += np.random.default_rng(5).normal(0, 18, rgb.shape)
    img = Image.fromarray(np.clip(rgb, 0, 255).astype(np.uint8))
    for q in (95, 90, 85, 75, 60):
        buf = io.BytesIO()
        img.save(buf, "JPEG", quality=q)
        if buf.tell() <= 1.5 * target:
            break
    path.write_bytes(buf.getvalue())
    return buf.tell()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def served(tmp_path):
    """`epd-encoder serve` as `make serve` runs it, on a tiny checkpoint and a free port."""
    model = write_tiny_model("qwen2_5_vl", tmp_path / "tiny")
    port = free_port()
    log = open(tmp_path / "serve.log", "wb")
    proc = subprocess.Popen([str(EPD), "serve", "--model", str(model), "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    try:
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "server not ready in 120 s"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)  # polling a subprocess's readiness: no event to wait on
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def json_objects(text: str) -> list:
    dec, out, i = json.JSONDecoder(), [], 0
    while (i := text.find("{", i)) != -1:
        try:
            obj, end = dec.raw_decode(text, i)
        except ValueError:
            i += 1
            continue
        out.append(obj)
        i = end
    return out


@pytest.mark.skipif(shutil.which("curl") is None or shutil.which("base64") is None,
                    reason="curl and base64 (coreutils) are what the README's example runs")
def test_readme_curl_example_works_with_a_1mb_photo(served, tmp_path):
    img = tmp_path / "photo.jpg"
    size = photo(img)
    assert size > 700_000  # past the 128 KiB argument limit many times over, once base64'd
    block = curl_block()
    lines = block.splitlines()
    assert lines[0].startswith("IMG=")
    # The reader's own photo replaces the generated one; the server is this test's.
    script = "\n".join([f"IMG={img}", *(ln for ln in lines[1:] if "Image.new" not in ln)])
    script = script.replace("127.0.0.1:8000", f"127.0.0.1:{served}")
    run = subprocess.run(["bash", "-euo", "pipefail", "-c", script], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    answers = [o for o in json_objects(run.stdout) if "items" in o]
    assert len(answers) == 1, run.stdout[:2000]
    (item,) = answers[0]["items"]
    assert re.fullmatch(r"[0-9a-f]{64}", item["key"]) and item["num_tokens"] > 0 and item["cache"] == "miss"
    assert len(item["grid_thw"]) == 3
    assert re.search(r'^epd_items_total\{cache="miss"\} 1\.0$', run.stdout, flags=re.M), run.stdout[-2000:]
    # The key is the photo's bytes: fetching it back gives the tensors.
    got = httpx.get(f"http://127.0.0.1:{served}{item['url']}", timeout=30)
    assert got.status_code == 200 and len(got.content) > item["num_tokens"]


def test_readme_generated_image_line_runs(tmp_path):
    # The example's own image line, with the venv's python, makes a readable image.
    (line,) = [ln for ln in curl_block().splitlines() if "Image.new" in ln]
    line = line.replace(".venv/bin/python", sys.executable)
    out = tmp_path / "img.png"
    run = subprocess.run(["bash", "-c", f"IMG={out}\n{line}"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert Image.open(out).size == (200, 120)
