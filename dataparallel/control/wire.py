"""Frames of the control protocol: ``HMAC-SHA256(key, direction || body) || body``, body a
protobuf.

The key is derived from the job token, so a frame proves its sender knows the token and
was not altered on the way; replies are sealed the same way, so a client knows it talks
to the real coordinator. The MAC also covers the frame's direction (a domain tag for
requests, another for replies, never sent), so a client's own request bounced back to it
does not open as a reply, nor a reply sent to the coordinator as a request. Which request
a reply answers is bound inside it: its ``id`` and ``answers`` (the request's session, or
a hello's nonce), which the client checks (:mod:`dataparallel.control.remote`). (Frames are
readable on the network unless the transport encrypts them, as ZeroMQ does with
``?curve=1``.) Shared by every coordinator-based transport.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import threading

from ..errors import AuthError, BadMessage
from .v1 import control_pb2 as pb

#: Bumped on any incompatible change of the schema's meaning.
PROTOCOL_VERSION = 5  # 2: multi_get, multi_set, append; 3: direction under the MAC, replies bound; 4: join;
# 5: multi_compare_set, delete_many
#: The largest job a coordinator (and a channel) accepts: collectives hold per-rank state.
MAX_WORLD_SIZE = 1 << 20
#: Largest frame a coordinator accepts (a value is meant to be small: ids, commands, reports).
MAX_FRAME = 64 << 20
MAC_SIZE = 32

__all__ = [
    "MAC_SIZE",
    "MAX_FRAME",
    "PROTOCOL_VERSION",
    "PURPOSES",
    "Misdirected",
    "open_frame",
    "pb",
    "purpose_key",
    "root_key",
    "seal",
    "token_key",
]

#: The root key's KDF: scrypt (RFC 7914), N=2**15, r=8, p=1 — about 0.1 s and 32 MiB, once per
#: process and token — so a captured frame lets an attacker test token guesses
#: at scrypt's speed, not at SHA-256's. The salt is fixed, not the job's name: one coordinator
#: serves many jobs and must check a frame's MAC before it can trust the job named inside it.
SCRYPT = {"n": 1 << 15, "r": 8, "p": 1}
_SALT = b"dataparallel/control/v1"
#: One key per purpose, never sent over the wire; knowing one tells nothing of the others.
PURPOSES = ("frame-mac", "curve-server", "grpc-frame-mac", "rendezvous-state", "token-check")


_root_keys: dict[str, bytes] = {}
_NO_TOKEN = hashlib.sha256(_SALT + b"/no-token").digest()
_root_lock = threading.Lock()


def root_key(token: str | None) -> bytes:
    """The job token's root key. Computed once per process and token: threads that ask at
    once wait for the one computation. Without a token (``None`` or ``""``) the key is public
    anyway: a constant, with no KDF to pay for."""
    if not token:
        return _NO_TOKEN
    key = _root_keys.get(token)
    if key is None:
        with _root_lock:
            key = _root_keys.get(token)
            if key is None:
                key = hashlib.scrypt(token.encode(), salt=_SALT, dklen=32, maxmem=64 << 20, **SCRYPT)
                _root_keys[token] = key
    return key


@functools.lru_cache(maxsize=128)
def purpose_key(token: str | None, purpose: str) -> bytes:
    """The key for one ``purpose`` (one of :data:`PURPOSES`): HKDF-Expand (RFC 5869) of the
    root key, one block, with the purpose as its info."""
    if purpose not in PURPOSES:
        raise ValueError(f"unknown key purpose {purpose!r}; one of {', '.join(PURPOSES)}")
    return hmac.digest(root_key(token), b"dataparallel/" + purpose.encode() + b"\x01", "sha256")


def token_key(token: str | None) -> bytes:
    """The key that signs zmq frames (the ``frame-mac`` purpose)."""
    return purpose_key(token, "frame-mac")


#: The direction of a frame, under its MAC and never sent: a request and a reply with the same
#: bytes have different MACs, so neither can be passed off as the other.
DIRECTIONS: dict[type, bytes] = {
    pb.Request: b"dataparallel/control/v1 request\x00",
    pb.Reply: b"dataparallel/control/v1 reply\x00",
}


class Misdirected(AuthError):
    """A frame sealed with this job's key for the other direction: a request where a reply
    was expected (a client's own request bounced back to it) or the reverse. Sent by no
    correct peer; the receiver drops it, counts it, and waits on for the true one."""


def _mac(key: bytes, kind: type, body: bytes) -> bytes:
    mac = hmac.new(key, DIRECTIONS[kind], "sha256")
    mac.update(body)
    return mac.digest()


def seal(key: bytes, message: pb.Request | pb.Reply) -> bytes:
    body = message.SerializeToString()
    return _mac(key, type(message), body) + body


def open_frame(key: bytes, frame: bytes, kind: type[pb.Request] | type[pb.Reply]) -> pb.Request | pb.Reply:
    """Verify and parse a frame; :class:`Misdirected` for a frame sealed for the other
    direction, :class:`AuthError` for any other bad MAC, :class:`BadMessage` for anything
    that is not a well-formed frame of ``kind``."""
    if len(frame) > MAX_FRAME:
        raise BadMessage(f"frame of {len(frame)} bytes exceeds the limit of {MAX_FRAME}")
    if len(frame) < MAC_SIZE:
        raise BadMessage(f"frame of {len(frame)} bytes is shorter than its MAC")
    mac, body = frame[:MAC_SIZE], frame[MAC_SIZE:]
    if not hmac.compare_digest(mac, _mac(key, kind, body)):
        other = pb.Reply if kind is pb.Request else pb.Request
        if hmac.compare_digest(mac, _mac(key, other, body)):
            raise Misdirected(
                f"a {other.__name__.lower()} frame where a {kind.__name__.lower()} was expected "
                "(bounced back or redirected on the way)"
            )
        raise AuthError("frame not signed with this job's token (wrong token, or altered in transit)")
    message = kind()
    try:
        message.ParseFromString(body)
    except Exception as err:  # protobuf raises DecodeError and, for some inputs, others
        raise BadMessage(f"undecodable {kind.__name__}: {err}") from None
    return message
