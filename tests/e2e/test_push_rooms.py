# SPDX-License-Identifier: Apache-2.0
"""Push room names are scoped to their receiver, on the server and at GET /v1/rooms/{room}."""

from __future__ import annotations

import pytest
import torch

from epd_encoder.receiver import EmbeddingReceiver
from tests.e2e.harness import body, png, wait_for
from tests.e2e.test_push import direct


def room_status(client, room, receiver):
    return client.get(f"/v1/rooms/{room}", params={"receiver": receiver})


def test_two_prefills_may_name_the_same_room(server, client):
    a, b = png(1100), png(1101, (56, 84))
    with EmbeddingReceiver("tcp", pool_bytes=8 << 20) as rx1, EmbeddingReceiver("tcp", pool_bytes=8 << 20) as rx2:
        with server.paused_engine():  # both rooms are open at once
            r1 = client.post("/v1/encode", json=body(a, delivery=rx1.delivery("room-1")))
            r2 = client.post("/v1/encode", json=body(b, delivery=rx2.delivery("room-1")))
            assert r1.status_code == 202, r1.text
            assert r2.status_code == 202, r2.text
            assert room_status(client, "room-1", rx1.endpoint).json()["request_id"] == r1.json()["request_id"]
            assert room_status(client, "room-1", rx2.endpoint).json()["request_id"] == r2.json()["request_id"]
        got1, got2 = rx1.wait("room-1", timeout=20), rx2.wait("room-1", timeout=20)
    torch.testing.assert_close(got1[0].embedding, direct(server, a).embedding, atol=1e-5, rtol=0)
    torch.testing.assert_close(got2[0].embedding, direct(server, b).embedding, atol=1e-5, rtol=0)
    for rx, r in ((rx1, r1), (rx2, r2)):
        status = room_status(client, "room-1", rx.endpoint).json()
        assert status["state"] == "done" and status["request_id"] == r.json()["request_id"]


def test_room_status_answers_only_its_own_receiver(server, client):
    with EmbeddingReceiver("tcp") as owner, EmbeddingReceiver("tcp") as other:
        assert client.post("/v1/encode", json=body(png(1102), delivery=owner.delivery("room-own"))).status_code == 202
        owner.wait("room-own", timeout=20)
        assert room_status(client, "room-own", owner.endpoint).json()["state"] == "done"
        for receiver in (other.endpoint, "tcp://10.9.9.9:1", "not-an-endpoint"):
            r = room_status(client, "room-own", receiver)
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
            assert "room-own" in r.json()["error"]["message"]
        assert room_status(client, "never-seen", owner.endpoint).status_code == 404
        assert client.get("/v1/rooms/room-own").status_code == 422  # the receiver must be named


def test_the_same_room_from_the_same_receiver_while_open_is_a_conflict(server, client):
    with EmbeddingReceiver("tcp", pool_bytes=8 << 20) as rx:
        delivery = rx.delivery("room-twice")
        with server.paused_engine():
            first = client.post("/v1/encode", json=body(png(1103), delivery=delivery))
            again = client.post("/v1/encode", json=body(png(1104), delivery=delivery))
            assert first.status_code == 202, first.text
            assert again.status_code == 409 and again.json()["error"]["code"] == "duplicate_request"
        items = rx.wait("room-twice", timeout=20)
    assert items[0].key == first.json()["items"][0]["key"]


def test_an_int_room_round_trips_as_its_decimal_string(server, client):
    room = 2**63 - 1  # SGLang-style bootstrap rooms are 64-bit ints
    with EmbeddingReceiver("tcp", pool_bytes=8 << 20) as rx:
        r = client.post("/v1/encode", json=body(png(1105), delivery=rx.delivery(room)))
        assert r.status_code == 202, r.text
        assert r.json()["room"] == str(room)
        items = rx.wait(room, timeout=20)
        assert items[0].key == r.json()["items"][0]["key"]
        assert room_status(client, str(room), rx.endpoint).json()["state"] == "done"
        raw = {**rx.delivery(7), "room": 7}  # a JSON int, as any client may send it
        r = client.post("/v1/encode", json=body(png(1106), delivery=raw))
        assert r.status_code == 202, r.text
        assert rx.wait("7", timeout=20)[0].key == r.json()["items"][0]["key"]


@pytest.mark.parametrize("backend", ["tcp", "zmq", "shm"])
def test_a_room_name_is_reusable_once_its_room_finished_unclaimed(server, client, backend):
    first_image, second_image = png(1107), png(1108)
    with EmbeddingReceiver(backend, pool_bytes=8 << 20) as rx:
        assert client.post("/v1/encode", json=body(first_image)).status_code == 200  # cached: the push is instant
        first = client.post("/v1/encode", json=body(first_image, delivery=rx.delivery("reused")))
        assert first.status_code == 202, first.text
        assert wait_for(lambda: rx.poll("reused") == "done")  # finished here, never claimed
        again = client.post("/v1/encode", json=body(second_image, delivery=rx.delivery("reused")))
        assert again.status_code == 202, again.text
        assert wait_for(lambda: room_status(client, "reused", rx.endpoint).json()["state"] in ("done", "failed"))
        status = room_status(client, "reused", rx.endpoint).json()
        assert status["request_id"] == again.json()["request_id"]
        assert status["state"] == "done", status
        items = rx.wait("reused", timeout=20)
    assert items[0].key == again.json()["items"][0]["key"]
    torch.testing.assert_close(items[0].embedding, direct(server, second_image).embedding, atol=1e-5, rtol=0)


@pytest.mark.parametrize("backend", ["tcp", "zmq"])
def test_a_new_request_takes_over_a_finished_room_its_delivery_did_not_register(server, client, backend):
    """A delivery built from the target alone (a TP rank, or a client that registers late) reaches
    the receiver as an Offer for a name whose unclaimed room is done: the newer request wins."""
    with EmbeddingReceiver(backend, pool_bytes=8 << 20) as rx:
        first = client.post("/v1/encode", json=body(png(1109), delivery=rx.delivery("taken-over")))
        assert first.status_code == 202, first.text
        assert wait_for(lambda: rx.poll("taken-over") == "done")
        raw = {"mode": "push", "backend": backend, "room": "taken-over", "targets": [rx.target()]}
        again = client.post("/v1/encode", json=body(png(1112), delivery=raw))
        assert again.status_code == 202, again.text
        assert wait_for(lambda: room_status(client, "taken-over", rx.endpoint).json()["state"] in ("done", "failed"))
        assert room_status(client, "taken-over", rx.endpoint).json()["state"] == "done"
        assert rx.wait("taken-over", timeout=20)[0].key == again.json()["items"][0]["key"]
