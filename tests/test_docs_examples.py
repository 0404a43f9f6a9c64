# SPDX-License-Identifier: Apache-2.0
"""Every fenced block of README.md and docs/*.md is a promise: it runs here, in file order,
against one real `epd-encoder serve` on the built-in tiny model (as `make serve` runs it),
or it is marked not run with a reason. The convention is in docs/contributing.md."""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import os
import pathlib
import re
import shutil
import socket
import subprocess
import sys
import time
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image

ROOT = pathlib.Path(__file__).resolve().parents[1]
BIN = pathlib.Path(sys.executable).parent
EPD = BIN / "epd-encoder"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^( *)(```+)([^`\s]*)[^`]*$")
MARK = re.compile(r"^\s*<!--\s*(not run|run):\s*(.*?)\s*-->\s*$")
RUN_AS_WRITTEN = {"bash", "python"}
JSON_RUNS = re.compile(r"^(POST /v1/encode|GET /\S+)$")
# Values of /info that belong to the machine, not to the server: their shape is still checked.
MACHINE_VALUES = {"cpus"}


@dataclasses.dataclass(frozen=True)
class Block:
    path: str
    line: int  # the opening fence, 1-based
    lang: str
    code: str
    mark: str | None  # "run" or "not run": the HTML comment on the line before the fence
    arg: str  # the mark's text: what to run, or why not

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"


def parse(text: str, path: str) -> list[Block]:
    lines, out, i = text.splitlines(), [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.groups()
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            j += 1
        body = [ln[len(indent):] if ln.startswith(indent) else ln.lstrip() for ln in lines[i + 1:j]]
        k = i - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        mark = MARK.match(lines[k]) if k >= 0 else None
        out.append(Block(path, i + 1, lang, "\n".join(body) + "\n",
                         mark.group(1) if mark else None, mark.group(2) if mark else ""))
        i = j + 1
    return out


def problem(b: Block) -> str | None:
    """Why a block is neither run nor properly marked not run; None when it is one of them."""
    if b.mark == "not run":
        return None if b.arg else "<!-- not run: ... --> needs a reason"
    if b.lang == "text":
        return "a text block is never run: drop the run mark" if b.mark else None
    if b.lang in RUN_AS_WRITTEN:
        return "a bash/python block runs as written: drop the run mark" if b.mark else None
    if b.lang == "json":
        if b.mark == "run" and JSON_RUNS.match(b.arg):
            return None
        return "a json block needs <!-- run: POST /v1/encode --> or <!-- run: GET /path -->, or a not-run reason"
    return (f"language {b.lang or '(none)'!r}: use bash, python or json (run), text (not code), "
            "or mark it <!-- not run: reason -->")


def all_blocks() -> list[Block]:
    return [b for doc in DOCS for b in parse(doc.read_text(), str(doc.relative_to(ROOT)))]


def runnable(blocks: list[Block]) -> list[Block]:
    return [b for b in blocks if b.mark != "not run" and b.lang in RUN_AS_WRITTEN | {"json"}]


# -- the convention itself ---------------------------------------------------------------


def test_every_block_is_run_or_marked_not_run_with_a_reason():
    problems = [f"{b.id}: {p}" for b in all_blocks() if (p := problem(b))]
    assert not problems, "\n".join(problems)


def test_the_convention_refuses_unmarked_and_unreasoned_blocks():
    md = ("```\nx\n```\n\n<!-- not run:  -->\n```bash\nrm -rf /\n```\n\n```json\n{}\n```\n\n"
          "  <!-- not run: needs a GPU -->\n  ```python\n  import torch\n  ```\n\n"
          "```text\nout\n```\n<!-- run: GET /info -->\n```json\n{}\n```\n")
    got = [(b.line, b.lang, problem(b) is None) for b in parse(md, "x.md")]
    assert got == [(1, "", False), (6, "bash", False), (10, "json", False),
                   (15, "python", True), (19, "text", True), (23, "json", True)]
    (gpu,) = [b for b in parse(md, "x.md") if b.lang == "python"]
    assert gpu.code == "import torch\n" and gpu.arg == "needs a GPU"


# -- one server, the docs' files ---------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def png() -> bytes:
    y, x = np.mgrid[0:120, 0:200]
    buf = io.BytesIO()
    Image.fromarray(np.stack([x % 256, y * 2 % 256, (x + y) % 256], -1).astype(np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def mp4(frames: int = 8, rate: int = 8) -> bytes:
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as c:
        s = c.add_stream("mpeg4", rate=rate)
        s.width, s.height, s.pix_fmt = 64, 48, "yuv420p"
        y, x = np.mgrid[0:48, 0:64]
        for i in range(frames):
            rgb = np.stack([(x * 3 + i * 9) % 256, (y * 4) % 256, (x + y + i * 5) % 256], -1).astype(np.uint8)
            for p in s.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return buf.getvalue()


@dataclasses.dataclass
class Served:
    url: str
    port: int
    work: pathlib.Path  # the docs' /tmp/: each run writes into its own directory


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """`epd-encoder serve` with no --model, as `make serve` runs it (its tiny model built in a
    temporary cache), on a free port of a CPU host; the reader's own file (/tmp/clip.mp4) made first."""
    base = tmp_path_factory.mktemp("docs")
    work = base / "tmp"
    work.mkdir()
    (work / "clip.mp4").write_bytes(mp4())
    port = free_port()
    # CUDA hidden: the documented answers (/info's device and dtype) are a CPU host's.
    env = {**os.environ, "EPD_ENCODER_CACHE": str(base / "cache"), "CUDA_VISIBLE_DEVICES": ""}
    log = open(base / "serve.log", "wb")
    proc = subprocess.Popen([str(EPD), "serve", "--port", str(port)], stdout=log,
                            stderr=subprocess.STDOUT, cwd=base, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    try:
        while True:
            assert proc.poll() is None, (base / "serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "server not ready in 180 s"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)  # polling a subprocess's readiness: no event to wait on
        yield Served(url, port, work)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def localize(code: str, s: Served) -> str:
    """The reader's setting, mapped to this run: the server's port for `make serve`'s 8000,
    a private directory for /tmp/, and this interpreter's venv for .venv/bin/."""
    for host in ("127.0.0.1:8000", "localhost:8000"):
        code = code.replace(host, f"127.0.0.1:{s.port}")
    return code.replace("/tmp/", f"{s.work}/").replace(".venv/bin/", f"{BIN}/")


def fill(value: Any, media: dict[str, bytes], kind: str = "image") -> Any:
    """A request example's placeholders (`<...>`, `data:...;base64,...`) filled with real media."""
    if isinstance(value, dict):
        kind = str(value.get("type", kind)).removesuffix("_url")
        return {k: fill(v, media, kind) for k, v in value.items()}
    if isinstance(value, list):
        return [fill(v, media, kind) for v in value]
    if isinstance(value, str) and value.endswith("base64,..."):
        return value.removesuffix("...") + base64.b64encode(media[kind]).decode()
    if isinstance(value, str) and value.startswith("<") and value.endswith(">"):
        return base64.b64encode(media[kind]).decode()
    return value


def same_shape(doc: Any, real: Any, where: str = "", machine: bool = False) -> list[str]:
    """Where the documented answer differs from the real one: keys everywhere, values except
    the machine's own (under MACHINE_VALUES)."""
    if isinstance(doc, dict) and isinstance(real, dict):
        diffs = [] if set(doc) == set(real) else [
            f"{where or '.'}: documented keys {sorted(set(doc) - set(real))} are not answered, "
            f"answered keys {sorted(set(real) - set(doc))} are not documented"]
        for k in sorted(set(doc) & set(real)):
            diffs += same_shape(doc[k], real[k], f"{where}.{k}", machine or k in MACHINE_VALUES)
        return diffs
    if isinstance(doc, list) and isinstance(real, list) and len(doc) == len(real):
        return [d for i, (a, b) in enumerate(zip(doc, real)) for d in same_shape(a, b, f"{where}[{i}]", machine)]
    return [] if machine or doc == real else [f"{where}: documented {doc!r}, answered {real!r}"]


def run_json(b: Block, s: Served) -> None:
    doc = json.loads(b.code)
    method, path = b.arg.split()
    if method == "GET":
        r = httpx.get(s.url + path, timeout=30)
        assert r.status_code == 200, r.text
        diffs = same_shape(doc, r.json())
        assert not diffs, f"{b.id} vs GET {path}:\n" + "\n".join(diffs)
        return
    body = fill(doc, {"image": png(), "video": (s.work / "clip.mp4").read_bytes()})
    r = httpx.post(s.url + path, json=body, timeout=120)
    assert r.status_code == 200, f"{b.id}: {r.status_code} {r.text}"


def run_code(b: Block, s: Served) -> None:
    code = localize(b.code, s)
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "VIRTUAL_ENV": str(BIN.parent)}
    if b.lang == "bash":
        argv = ["bash", "-euo", "pipefail", "-c", code]
    else:
        script = s.work / f"block_{b.path.replace('/', '_')}_{b.line}.py"
        script.write_text(code)
        argv = [sys.executable, str(script)]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=240, cwd=s.work, env=env)
    assert run.returncode == 0, f"{b.id} exited {run.returncode}:\n{code}\n--- stderr\n{run.stderr[-3000:]}"
    # curl -s exits 0 on an HTTP error: an error body in the output is the example failing.
    assert not re.search(r'"error":\s*\{', run.stdout), f"{b.id} printed an error:\n{run.stdout[-3000:]}"


@pytest.mark.parametrize("block", runnable(all_blocks()), ids=lambda b: b.id)
def test_docs_block_runs(block: Block, served: Served):
    if block.lang == "bash" and "curl " in block.code and shutil.which("curl") is None:
        pytest.skip("curl is what this example runs")
    if block.lang == "json":
        run_json(block, served)
    else:
        run_code(block, served)


# -- the README's curl example with a real photo -------------------------------------------


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
def test_readme_curl_example_works_with_a_1mb_photo(served: Served, tmp_path):
    img = tmp_path / "photo.jpg"
    assert photo(img) > 700_000  # past the 128 KiB argument limit many times over, once base64'd
    (block,) = [b for b in all_blocks() if b.path == "README.md" and "--data-binary @-" in b.code]
    lines = localize(block.code, served).splitlines()
    (at,) = [i for i, ln in enumerate(lines) if ln.startswith("IMG=")]
    # The reader's own photo replaces the generated one.
    script = "\n".join([*lines[:at], f"IMG={img}", *(ln for ln in lines[at + 1:] if "Image.new" not in ln)])
    run = subprocess.run(["bash", "-euo", "pipefail", "-c", script], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    answers = [o for o in json_objects(run.stdout) if "items" in o]
    assert len(answers) == 1, run.stdout[:2000]
    (item,) = answers[0]["items"]
    assert re.fullmatch(r"[0-9a-f]{64}", item["key"]) and item["num_tokens"] > 0 and item["cache"] == "miss"
    assert len(item["grid_thw"]) == 3
    assert re.search(r'^epd_items_total\{cache="miss"\} [1-9]', run.stdout, flags=re.M), run.stdout[-2000:]
    # The key is the photo's bytes: fetching it back gives the tensors.
    got = httpx.get(f"{served.url}{item['url']}", timeout=30)
    assert got.status_code == 200 and len(got.content) > item["num_tokens"]
