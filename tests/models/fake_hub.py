# SPDX-License-Identifier: Apache-2.0
"""A fake Hugging Face Hub: a real loopback HTTP server speaking the file endpoints.

huggingface_hub's ``hf_hub_download`` asks ``HEAD /{repo}/resolve/{rev}/{file}``
for ``X-Repo-Commit``, ``ETag`` and ``Content-Length``, then GETs the same URL;
a 404 carries ``X-Error-Code`` (RepoNotFound / RevisionNotFound / EntryNotFound).
``snapshot_download`` (what ``hf download`` runs) first asks
``GET /api/models/{repo}/revision/{rev}`` for the commit and
``GET /api/models/{repo}/tree/{commit}`` for the file list. Every path asked for is logged.
"""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote


def commit_of(tag: str) -> str:
    return hashlib.sha1(tag.encode()).hexdigest()


class FakeHub:
    """repos: {repo_id: {revision_or_commit: (commit, directory)}}."""

    def __init__(self, repos: dict[str, dict[str, tuple[str, Path]]]) -> None:
        self.repos = repos
        self.requests: list[tuple[str, str]] = []  # (method, path)
        self._lock = threading.Lock()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep pytest output clean
                pass

            def do_HEAD(self):
                hub._answer(self, body=False)

            def do_GET(self):
                hub._answer(self, body=True)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()

    def files(self, repo: str) -> list[str]:
        """Files asked for (HEAD or GET) in ``repo``, by name."""
        prefix = f"/{repo}/resolve/"
        return [p[len(prefix):].split("/", 1)[1] for _, p in self.requests if p.startswith(prefix)]

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(timeout=10)

    def _answer(self, h: BaseHTTPRequestHandler, *, body: bool) -> None:
        path = unquote(h.path.split("?", 1)[0])
        with self._lock:
            self.requests.append((h.command, path))
        parts = path.lstrip("/").split("/")
        if parts[0] == "api":
            return self._api(h, parts[1:])
        # /{org}/{name}/resolve/{revision}/{filename}
        if len(parts) < 5 or parts[2] != "resolve":
            return self._error(h, 404, "RepoNotFound")
        repo, rev, filename = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
        if repo not in self.repos:
            return self._error(h, 404, "RepoNotFound")
        if rev not in self.repos[repo]:
            return self._error(h, 404, "RevisionNotFound")
        commit, root = self.repos[repo][rev]
        f = root / filename
        if not f.is_file():
            return self._error(h, 404, "EntryNotFound", commit)
        data = f.read_bytes()
        h.send_response(200)
        h.send_header("X-Repo-Commit", commit)
        h.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
        h.send_header("Content-Length", str(len(data)))
        h.send_header("Content-Type", "application/octet-stream")
        h.end_headers()
        if body:
            h.wfile.write(data)

    def _api(self, h: BaseHTTPRequestHandler, parts: list[str]) -> None:
        # models/{org}/{name}/revision/{rev} | models/{org}/{name}/tree/{rev}
        if len(parts) < 5 or parts[0] != "models" or parts[3] not in ("revision", "tree"):
            return self._error(h, 404, "RepoNotFound")
        repo, kind, rev = "/".join(parts[1:3]), parts[3], parts[4]
        if repo not in self.repos:
            return self._error(h, 404, "RepoNotFound")
        if rev not in self.repos[repo]:
            return self._error(h, 404, "RevisionNotFound")
        commit, root = self.repos[repo][rev]
        files = sorted(str(f.relative_to(root)) for f in root.rglob("*") if f.is_file())
        if kind == "revision":
            value: object = {"id": repo, "sha": commit, "siblings": [{"rfilename": f} for f in files]}
        else:
            value = [{"type": "file", "path": f, "size": (root / f).stat().st_size,
                      "oid": hashlib.sha1((root / f).read_bytes()).hexdigest()} for f in files]
        msg = json.dumps(value).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(msg)))
        h.end_headers()
        if h.command == "GET":
            h.wfile.write(msg)

    @staticmethod
    def _error(h, status: int, code: str, commit: str | None = None) -> None:
        msg = json.dumps({"error": code}).encode()
        h.send_response(status)
        h.send_header("X-Error-Code", code)
        if commit:
            h.send_header("X-Repo-Commit", commit)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(msg)))
        h.end_headers()
        if h.command == "GET":
            h.wfile.write(msg)
