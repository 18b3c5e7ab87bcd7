"""A reply can only be the reply to this request of this session, against a real attacker on
the path (tests/mitm.py: it relays zmq frames or gRPC streams, and holds no token).

- A client's own request bounced back to it is not a reply: its ``set`` is not
  "acknowledged" before it arrived, its ``get`` does not read ``b""``, its ``add`` does not
  read 0, its barrier does not end before the others came. The client refuses the bounced
  frame, counts it, and takes the true reply, which comes later, within its timeout.
- A reply recorded from an earlier run (another job, another session, the same token) and
  played back to a new client is refused in the same way, the hello's reply included.
"""

from __future__ import annotations

import threading
import time

import pytest
from mitm import GrpcMitm, ZmqMitm

import dataparallel as dp
from dataparallel.control.coordinator import Coordinator
from dataparallel.control.wire import Misdirected, open_frame, pb, seal, token_key
from dataparallel.testing import close_all, free_port, run_all

TOKEN = "shared-token"
MITMS = {"zmq": ZmqMitm, "grpc": GrpcMitm}


@pytest.fixture(params=sorted(MITMS))
def path(request):
    """A coordinator (hosted by rank 0 of job ``host``) and an attacker in front of it."""
    scheme = request.param
    host = dp.connect(f"{scheme}://127.0.0.1:{free_port()}", rank=0, world_size=1, job="host", token=TOKEN, timeout=20)
    mitm = MITMS[scheme](host.port)
    try:
        yield scheme, host.port, mitm
    finally:
        mitm.close()
        host.close()


@pytest.mark.timeout(120)
def test_a_request_bounced_back_is_not_its_reply(path):
    scheme, port, mitm = path
    direct = f"{scheme}://127.0.0.1:{port}"
    via = f"{scheme}://127.0.0.1:{mitm.port}"
    # Rank 0 reaches the coordinator directly; rank 1 only through the attacker.
    rank0 = dp.connect(direct, rank=0, world_size=2, job="j", token=TOKEN, timeout=20)
    opened: list[dp.ControlChannel] = [rank0]
    try:
        rank1 = dp.connect(via, rank=1, world_size=2, job="j", **KW)
        opened.append(rank1)
        run_all([rank0.rendezvous, rank1.rendezvous])

        mitm.mode = "reflect"
        rank1.set("written", b"by rank 1")
        # Acknowledged only once the coordinator holds it: the attacker relays it late.
        assert rank0.check(["written"]), "set acknowledged by its own request bounced back"

        rank0.set("held", b"a value")
        assert rank1.get("held", timeout=10) == b"a value"
        assert rank1.add("counter", 5) == 5
        assert rank1.compare_set("cas", b"", b"new") == b"new"

        entered: list[float] = []

        def late_rank0() -> None:
            time.sleep(1.0)
            entered.append(time.monotonic())
            rank0.barrier("b")

        late = threading.Thread(target=late_rank0)
        late.start()
        rank1.barrier("b", timeout=10)
        left = time.monotonic()
        late.join(15)
        assert entered and left >= entered[0], "the barrier ended before rank 0 entered it"

        assert mitm.attacks >= 5
        assert rank1.refused_frames >= 5, rank1.refused_frames
        mitm.mode = "forward"
        assert rank1.get("written") == b"by rank 1"
    finally:
        mitm.mode = "forward"
        close_all(opened[::-1])


@pytest.mark.timeout(120)
def test_a_reply_recorded_from_an_earlier_run_is_refused(path):
    scheme, _, mitm = path
    via = f"{scheme}://127.0.0.1:{mitm.port}"

    # An earlier run, recorded by the attacker: the same token, another job.
    mitm.record = True
    early = dp.connect(via, rank=0, world_size=1, job="early", **KW)
    early.set("k", b"old")
    for _ in range(100):  # replies to reads of "k" under many ids (a confused client takes more)
        assert early.get("k") == b"old"
    early.close()
    mitm.record = False
    assert len(mitm.recorded) >= 20

    # A new run: every request of the new client is first answered with the recorded reply
    # of the same id (its hello's among them), and the true reply comes later.
    mitm.mode = "replay"
    late = dp.connect(via, rank=0, world_size=1, job="late", **KW)
    try:
        late.set("k", b"new")
        assert late.get("k") == b"new", "a reply of the earlier run answered the read"
        assert mitm.attacks >= 4
        assert late.refused_frames >= 4, late.refused_frames
    finally:
        mitm.mode = "forward"
        late.close()


KW = {"token": TOKEN, "timeout": 20}


def test_a_sealed_request_never_opens_as_a_reply_nor_a_reply_as_a_request():
    key = token_key(TOKEN)
    request = pb.Request(id=42, session=b"s" * 16, set=pb.KeyValue(key="k", value=b"v"))
    with pytest.raises(Misdirected):
        open_frame(key, seal(key, request), pb.Reply)
    with pytest.raises(Misdirected):
        open_frame(key, seal(key, pb.Reply(id=42, answers=b"s" * 16)), pb.Request)
    assert open_frame(key, seal(key, request), pb.Request) == request
    # The coordinator drops a reply sent to it as a request: there is no one to answer.
    coordinator = Coordinator(lambda route, reply: None)
    assert coordinator.handle_frame("route", key, seal(key, pb.Reply(id=1))) is None
