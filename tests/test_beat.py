"""Heartbeats over UDP: authenticated both ways, replays ignored, a wrong token reported."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from gcache.cluster import free_port
from gcache.meta.beat import BeatClient, BeatListener, beat_key, seal, unseal
from gcache.meta.master_client import AuthFailed, MasterClient
from tests.conftest import poll

TOKEN = "s3cret"


def test_seal_unseal_and_tampering():
    k = beat_key(TOKEN)
    msg = seal(k, {"v": 1, "node": "a", "inc": 1, "seq": 5})
    assert unseal(k, msg) == {"v": 1, "node": "a", "inc": 1, "seq": 5}
    assert unseal(beat_key("other"), msg) is None
    assert unseal(k, msg[:-1] + bytes([msg[-1] ^ 1])) is None
    assert unseal(k, bytes([msg[0] ^ 1]) + msg[1:]) is None
    assert unseal(k, b"short") is None
    assert unseal(k, seal(k, {"v": 2})) is None  # another version


@pytest.fixture
def listener():
    seen = []

    def handle(req):
        seen.append(req)
        return {"ok": True, "epoch": 7}

    port = free_port()
    lst = BeatListener("127.0.0.1", port, TOKEN, handle).start()
    yield lst, f"127.0.0.1:{port}", seen
    lst.stop()


def test_round_trip_and_replay(listener):
    _lst, address, seen = listener
    client = BeatClient([address], TOKEN)
    replies, auth = client.round({"node": "a", "inc": 1, "epoch": 0}, 2.0)
    assert replies == {address: {"ok": True, "epoch": 7}} and not auth
    assert seen[-1]["node"] == "a"
    # a captured request sent again is not evidence of life: no reply, not handled
    k = beat_key(TOKEN)
    old = seal(k, {"v": 1, "node": "a", "inc": 1, "seq": 1, "epoch": 0})
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(0.3)
        s.sendto(old, ("127.0.0.1", int(address.rsplit(":", 1)[1])))
        with pytest.raises(TimeoutError):
            s.recvfrom(1024)
    assert len(seen) == 1
    # a new incarnation starts its own sequence
    replies, _ = client.round({"node": "a", "inc": 2, "epoch": 0}, 2.0)
    assert replies and len(seen) == 2


def test_replays_of_two_incarnations_in_turn_are_not_evidence_of_life(listener):
    """Captured datagrams of a node's incarnations 1 and 2, replayed in turn: before, each one
    of incarnation 1 reset the mark kept for the node, so the next one of incarnation 2 passed
    again, and the dead node stayed up. Each is answered once, never again."""
    lst, _address, seen = listener
    k = beat_key(TOKEN)
    one = seal(k, {"v": 1, "node": "a", "inc": 1, "seq": 5, "epoch": 0})
    two = seal(k, {"v": 1, "node": "a", "inc": 2, "seq": 9, "epoch": 0})
    answered = [lst._answer(d) is not None for d in (one, two, one, two, one, two)]
    assert answered == [True, True, False, False, False, False]
    assert [(r["inc"], r["seq"]) for r in seen] == [(1, 5), (2, 9)]


def test_an_unauthenticated_reply_is_never_larger_than_its_request(listener):
    lst, _address, _seen = listener
    assert lst._answer(b"x") is None  # a 1-byte datagram: no 15-byte answer to a spoofed source
    junk = b"x" * 64
    reply = lst._answer(junk)
    assert reply is not None and len(reply) <= len(junk)


def test_a_master_name_that_does_not_resolve_is_left_out_not_fatal(listener, monkeypatch):
    """One master whose name does not resolve (a rescheduled pod, its DNS record not back yet)
    stopped every daemon from starting ("Name or service not known"). Now it is left out of the
    UDP round (its heartbeats go over gRPC) and looked up again later."""
    from gcache.meta import beat

    _lst, address, _seen = listener
    client = BeatClient([address, "gcache-master-2.invalid:7300"], TOKEN)
    replies, auth = client.round({"node": "a", "inc": 1, "epoch": 0}, 1.0)
    assert replies == {address: {"ok": True, "epoch": 7}} and not auth
    monkeypatch.setattr(beat, "RESOLVE_RETRY_S", 0.0)
    looked = []
    real = socket.getaddrinfo
    monkeypatch.setattr(socket, "getaddrinfo", lambda host, *a, **k: looked.append(host) or real(host, *a, **k))
    client._resolved_at = 0.0
    client.round({"node": "a", "inc": 1, "epoch": 0}, 1.0)
    assert poll(lambda: "gcache-master-2.invalid" in looked, 5)  # tried again, off the round's thread
    assert list(client.targets.values()) == [address]  # what resolved before is kept


def test_wrong_token_is_told_and_silent_masters_time_out(listener):
    _lst, address, seen = listener
    replies, auth = BeatClient([address], "wrong").round({"node": "a", "inc": 1, "epoch": 0}, 1.0)
    assert replies == {} and auth and not seen
    dead = f"127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    replies, auth = BeatClient([address, dead], TOKEN).round({"node": "b", "inc": 1, "epoch": 0}, 0.3)
    assert list(replies) == [address] and not auth
    assert 0.25 <= time.monotonic() - t0 < 2.0


def test_a_forged_or_stale_reply_is_not_taken(listener):
    """Only the reply to the seq just sent counts: a fake master answers 'ok' with an old seq."""
    fake = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    fake.bind(("127.0.0.1", 0))
    address = f"127.0.0.1:{fake.getsockname()[1]}"
    def serve():
        _data, addr = fake.recvfrom(1024)
        fake.sendto(seal(beat_key(TOKEN), {"v": 1, "seq": 1, "ok": True, "epoch": 99}), addr)

    th = threading.Thread(target=serve)
    th.start()
    replies, auth = BeatClient([address], TOKEN).round({"node": "a", "inc": 1, "epoch": 0}, 0.5)
    th.join()
    fake.close()
    assert replies == {} and not auth


def test_master_client_heartbeats_over_udp_and_says_when_the_token_is_wrong(tmp_path):
    from gcache.cluster import LocalCluster

    c = LocalCluster(nodes=0, masters=1, root=str(tmp_path)).start()
    try:
        mc = MasterClient(c.master_url, c.token)
        out = mc.call("Register", {"node": "n", "address": "127.0.0.1:1", "capacity": 1 << 30}, timeout_s=5.0)
        replies = mc.call_all("Heartbeat", {"node": "n", "inc": out["inc"], "epoch": 0}, timeout_s=1.0)
        assert len(replies) == 1 and replies[0]["ok"] and replies[0]["leader"]
        assert mc.call("Status", {})["master"]["udp_heartbeats"] >= 1
        with pytest.raises(AuthFailed):
            MasterClient(c.master_url, "wrong").call_all("Heartbeat", {"node": "n", "inc": 1, "epoch": 0},
                                                         timeout_s=1.0)
        mc.close()
    finally:
        c.stop()
