# SPDX-License-Identifier: Apache-2.0
"""/docs and /redoc render in a real headless Chromium with every request on loopback.

Chromium is Debian's (`make install` tries `apt-get install chromium`), driven by its own
``--dump-dom``; its net log records every request the page made. Host resolution is mapped
to nothing but 127.0.0.1, so a page that wanted a CDN would fail to render, and the log
would still name the request.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

from epd_encoder.api.openapi import ASSETS, ASSETS_URL
from epd_encoder.config import AuthConfig
from tests.e2e.harness import Server, serve_config
from tests.e2e.hostile import KEY

CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium installed (make install runs "
                                                          "`apt-get install chromium` where it can)")
OPERATIONS = ("/v1/encode", "/v1/embeddings/{key}", "/v1/rooms/{room}", "/health", "/v1/models", "/info",
              "/metrics")


@pytest.fixture(scope="module")
def docs_server(tiny_dir):
    # Keyed with --public-docs: the pages, their assets and /openapi.json must all be open.
    s = Server(serve_config(tiny_dir, auth=AuthConfig(api_key=KEY, public_docs=True))).start()
    yield s
    s.stop()


def render(url: str, tmp: Path) -> tuple[str, list[dict]]:
    """The DOM after the page's scripts ran, and the requests the page made (net log)."""
    netlog = tmp / "net.json"
    args = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
            "--disable-background-networking", "--disable-sync", "--disable-component-update",
            f"--user-data-dir={tmp / 'profile'}", f"--log-net-log={netlog}",
            "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
            # Virtual time runs until the page is idle (the spec fetched, the UI drawn), at most 20 s of it.
            "--virtual-time-budget=20000", "--dump-dom", url]
    done = subprocess.run(args, capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr[-2000:]
    log = json.loads(netlog.read_text())
    start = log["constants"]["logEventTypes"]["URL_REQUEST_START_JOB"]
    requests = [e["params"] for e in log["events"] if e["type"] == start and "params" in e]
    return done.stdout, requests


def page_requests(requests: list[dict], origin: str) -> list[str]:
    """Requests the page made: the navigation and whatever it started. Chromium's own
    background traffic (initiator 'not an origin', not the main frame) is not the page's."""
    return [r["url"] for r in requests if r.get("initiator") == origin or r.get("request_type") == "main frame"]


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
def test_docs_page_renders_every_operation_offline(docs_server, page, tmp_path):
    dom, requests = render(docs_server.url + page, tmp_path)
    made = page_requests(requests, docs_server.url)
    assert made and made[0] == docs_server.url + page, made
    off_box = [u for u in made if not u.startswith(docs_server.url + "/")]
    assert not off_box, f"{page} made requests beyond the server: {off_box}"
    assert docs_server.url + "/openapi.json" in made, "the page never fetched the spec"
    if page == "/docs":  # Swagger UI: one summary per operation, and the bearer 'Authorize' button
        drawn = set(re.findall(r'class="opblock-summary-path" data-path="([^"]+)"', dom))
        assert "btn authorize" in dom
    else:  # ReDoc: one section per operation, named by its operation id
        spec = httpx.get(docs_server.url + "/openapi.json", timeout=10).json()
        ids = {op["operationId"]: path for path, ops in spec["paths"].items() for op in ops.values()}
        drawn = {path for op_id, path in ids.items() if f'data-section-id="operation/{op_id}"' in dom}
    assert drawn == set(OPERATIONS), drawn


def test_served_pages_reference_only_local_urls(docs_server):
    with httpx.Client(base_url=docs_server.url, timeout=10) as c:
        for page in ("/docs", "/redoc", "/docs/oauth2-redirect"):
            r = c.get(page)
            assert r.status_code == 200, page
            assert "default-src 'self'" in r.headers["content-security-policy"]
            refs = re.findall(r'(?:src|href)\s*=\s*["\']([^"\']+)', r.text) + re.findall(r"url: '([^']+)'", r.text)
            assert all(ref.startswith("/") and not ref.startswith("//") for ref in refs), (page, refs)
            assert "cdn." not in r.text and "fonts.googleapis" not in r.text, page
        for name in ASSETS:  # open under --public-docs, as the pages that load them are
            r = c.get(f"{ASSETS_URL}/{name}")
            assert r.status_code == 200 and len(r.content) > 1000, name
