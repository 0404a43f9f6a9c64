# SPDX-License-Identifier: Apache-2.0
"""Push delivery through the real server to an EmbeddingReceiver, per backend."""

from __future__ import annotations

import importlib
import time

import httpx
import pytest
import torch

from epd_encoder.errors import EncodeFailed, NotFound
from epd_encoder.preprocess.decode import decode_image
from epd_encoder.receiver import EmbeddingReceiver
from tests.e2e.harness import body, png, wait_for


def _unavailable(modules: tuple[str, ...], package: str) -> str | None:
    """The skip reason when none of ``modules`` is installed; ``None`` when one imports, or
    when one is there but fails to import for any other reason (a missing system library, a
    missing dependency, a bug): that test then runs and fails on the error, never skips."""
    for module in modules:
        try:
            importlib.import_module(module)
            return None
        except ModuleNotFoundError as e:
            if e.name is not None and (module == e.name or module.startswith(e.name + ".")):
                continue  # the module itself, or its package, is absent
            return None
        except Exception:
            return None
    return f"{package} is not installed"


def _optional(name: str, modules: tuple[str, ...], package: str):
    reason = _unavailable(modules, package)
    return pytest.param(name, marks=pytest.mark.skipif(reason is not None, reason=str(reason)))


BACKENDS = ["tcp", "zmq", "shm", _optional("mooncake", ("mooncake.engine",), "mooncake-transfer-engine-non-cuda"),
            _optional("nixl", ("nixl._bindings", "nixl_cu12._bindings", "nixl_cu13._bindings"), "nixl-cu12")]


@pytest.mark.parametrize("error,skips", [
    (ModuleNotFoundError("No module named 'mooncake'", name="mooncake"), True),
    (ModuleNotFoundError("No module named 'mooncake.engine'", name="mooncake.engine"), True),
    (ModuleNotFoundError("No module named 'numpy'", name="numpy"), False),  # a dependency: a bug
    (ImportError("libibverbs.so.1: cannot open shared object file"), False),
    (RuntimeError("a bug at import time"), False),
])
def test_only_the_missing_package_is_a_skip(monkeypatch, error, skips):
    def import_module(name):
        raise error

    monkeypatch.setattr(importlib, "import_module", import_module)
    reason = _unavailable(("mooncake.engine",), "mooncake-transfer-engine-non-cuda")
    assert (reason == "mooncake-transfer-engine-non-cuda is not installed") if skips else reason is None


def direct(server, data):
    rt = server.runtime
    return rt.executor.encode([rt.preprocessor.preprocess(decode_image(data, rt.front.decode_limits))])[0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_push_round_trip_metadata_before_the_forward(server, client, backend):
    images = [png(1000), png(1001, (56, 200))]
    with EmbeddingReceiver(backend=backend, pool_bytes=8 << 20) as rx:
        with server.paused_engine():
            # The 202 and its metadata arrive while the tower is still busy.
            r = client.post("/v1/encode", json=body(*images, delivery=rx.delivery(f"room-{backend}")))
            assert r.status_code == 202, r.text
            meta = r.json()
            assert meta["room"] == f"room-{backend}" and len(meta["items"]) == 2
            assert rx.poll(f"room-{backend}") == "pending"
        items = rx.wait(f"room-{backend}", timeout=20)
    for data, info, item in zip(images, meta["items"], items):
        assert item.key == info["key"] and item.num_tokens == info["num_tokens"]
        assert list(item.grid_thw) == info["grid_thw"]
        torch.testing.assert_close(item.embedding, direct(server, data).embedding, atol=1e-5, rtol=0)
    status = client.get(f"/v1/rooms/room-{backend}", params={"receiver": rx.endpoint}).json()
    assert status["state"] == "done"


def _state(rx: EmbeddingReceiver, room: str) -> str | None:
    try:
        return rx.poll(room)  # a lookup: it does not register the room
    except NotFound:
        return None


def test_push_failure_reaches_a_room_registered_after_it(server, client):
    with EmbeddingReceiver(backend="tcp") as rx:
        bad = client.post("/v1/encode", json=body(png(3)[:150], delivery=rx.delivery("room-bad")))
        assert bad.status_code == 400  # preprocessing failures are answered on the request itself
        # Built from the target alone: unlike rx.delivery(), this does not register the room.
        late = {"mode": "push", "backend": "tcp", "room": "room-tower-fails", "targets": [rx.target()]}
        real = server.runtime.executor.encode
        server.runtime.executor.encode = lambda items: (_ for _ in ()).throw(RuntimeError("tower exploded"))
        try:
            assert client.post("/v1/encode", json=body(png(1002), delivery=late)).status_code == 202
            # The failure lands and is kept for a room nobody registered yet.
            assert wait_for(lambda: _state(rx, "room-tower-fails") == "failed")
        finally:
            server.runtime.executor.encode = real
        rx.expect("room-tower-fails")  # registered only now
        assert "room-tower-fails" in rx.ready_rooms()
        with pytest.raises(EncodeFailed, match="tower exploded"):
            rx.wait("room-tower-fails", timeout=0)  # answered from the kept failure, no waiting
    mine = {"receiver": rx.endpoint}
    assert client.get("/v1/rooms/room-tower-fails", params=mine).json()["state"] == "failed"
    assert client.get("/v1/rooms/never-seen", params=mine).status_code == 404


def test_push_to_a_receiver_that_is_gone_fails_the_room(tiny_dir):
    from dataclasses import replace

    from epd_encoder.config import PushConfig
    from tests.e2e.harness import Server, serve_config

    s = Server(serve_config(tiny_dir, push=replace(PushConfig(), bootstrap_timeout=0.5))).start()
    try:
        rx = EmbeddingReceiver(backend="tcp")
        delivery = rx.delivery("room-gone")
        rx.close()
        with httpx.Client(base_url=s.url, timeout=30) as c:
            assert c.post("/v1/encode", json=body(png(1003), delivery=delivery)).status_code == 202
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                st = c.get("/v1/rooms/room-gone", params={"receiver": rx.endpoint})
                if st.status_code == 200 and st.json()["state"] == "failed":
                    break
                time.sleep(0.05)
            assert st.json()["state"] == "failed" and st.json()["code"] == "timeout"
            assert s.runtime.engine.active_requests == 0
    finally:
        s.stop()


def test_push_delivery_schema(server, client):
    r = client.post("/v1/encode", json=body(png(1), delivery={"mode": "push", "backend": "tcp"}))
    assert r.status_code == 422
    r = client.post("/v1/encode", json=body(png(1), delivery={"mode": "push", "backend": "carrier-pigeon",
                                                           "room": "r", "targets": [{"endpoint": "tcp://127.0.0.1:1"}]}))
    assert r.status_code == 422, r.text


def test_push_targets_outside_the_allowlist_are_refused(tiny_dir):
    from dataclasses import replace

    from epd_encoder.config import PushConfig
    from tests.e2e.harness import Server, serve_config

    s = Server(serve_config(tiny_dir, push=replace(PushConfig(), push_allowed_targets="10.0.0.0/8"))).start()
    try:
        with EmbeddingReceiver(backend="tcp") as rx, httpx.Client(base_url=s.url, timeout=30) as c:
            r = c.post("/v1/encode", json=body(png(1004), delivery=rx.delivery("room-denied")))
            assert r.status_code == 400 and "not allowed" in r.json()["error"]["message"]
            assert s.runtime.engine.active_requests == 0
    finally:
        s.stop()
