"""Who may talk to a server's P/D ports (bootstrap registry, control channel): docs/disaggregation.md,
"The trust boundary".

With a shared token (``--disaggregation-auth-token``, ``--disaggregation-auth-token-file`` or
``PDSERVE_DISAGGREGATION_AUTH_TOKEN``: ``config.resolve_token``; the same on every prefill and decode server of a
deployment), every MAC says who sent it, for whom and when, so that a captured message is worth nothing elsewhere
or later:

- a control frame carries a ``FrameBinding`` (sender session, destination endpoint, the sender's sequence number,
  its time) under the MAC; the receiver (``channel.FrameGate``) refuses a frame for another endpoint, an old one,
  or a sequence number it has seen from that sender;
- a bootstrap request's MAC covers method, path, the registry it is meant for (``target``, host:port), a random
  nonce, the time and the body; the registry refuses another target and a nonce it has seen (``NonceCache``);
- a registry's answer carries a MAC over the request's nonce, its status and its body
  (``ANSWER_HEADER``): a client under a token takes records only from a registry that proves the token;
- a request's bootstrap fields (which registry decode fetches from, which room) carry the router's
  ``bootstrap_signature``: a MAC over every (host, port, room), the decode server it was sent to (the
  instance its ``/health`` names), an expiry and a nonce (``sign_route``); decode acts on no other
  (``disagg/routed.py``), so an API client cannot point decode at a registry of its choosing.

The token itself never crosses the network. Without a token, only loopback peers are accepted, unless the
operator says ``--disaggregation-allow-unauthenticated`` (a private network they trust); nothing is bound then.
What an HMAC does not give: secrecy (KV bytes and messages travel in clear; RDMA and the transfer engine are
outside this).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import math
import secrets
import struct
import time
from collections import OrderedDict
from dataclasses import dataclass, field

# An authenticated control frame: magic, 32-byte MAC, 2-byte binding length, binding, payload. "PDA1" (a MAC
# of the payload alone) is no longer accepted: it bound neither destination nor time.
FRAME_MAGIC = b"PDA2"
MAC_BYTES = 32
MAX_BINDING_BYTES = 1024  # two endpoints (at most 300 characters each), a session tag, two numbers
FRAME_OVERHEAD = len(FRAME_MAGIC) + MAC_BYTES + 2 + MAX_BINDING_BYTES  # the most a frame adds to its payload
SIGNATURE_HEADER = "X-PDServe-Signature"  # bootstrap request: "t=<unix seconds>,n=<nonce hex>,mac=<hex>"
ANSWER_HEADER = "X-PDServe-Answer"  # bootstrap answer: "mac=<hex>" over the request's nonce, status, body
MAX_CLOCK_SKEW_S = 300.0
NONCE_HEX = 32  # a bootstrap nonce: 128 random bits
MAX_NONCES = 1 << 17  # a registry's replay cache: far above what every decode's heartbeats send in the window
MAX_SENDERS = 4096  # control-frame senders whose sequence numbers a receiver remembers
ROUTE_TTL_S = 60  # a router's bootstrap_signature is good this long after it was made (plus clock skew)


def peer_auth(cfg) -> PeerAuth:
    """A server's rule from its ``config.DisaggConfig``."""
    return PeerAuth(cfg.auth_token, cfg.allow_unauthenticated)


class AuthError(ValueError):
    """A peer's frame or request is not accepted; the text says why (never the token)."""


class Misdirected(AuthError):
    """Signed bootstrap fields meant for another server (or an earlier run of this one)."""


def is_loopback(address: str | None) -> bool:
    if not address:
        return False
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class PeerAuth:
    """One server's rule for its P/D peers: ``token`` (None: none configured) and whether
    unauthenticated peers off the loopback are allowed."""

    token: str | None = field(default=None, repr=False)  # never in a log line
    allow_unauthenticated: bool = False

    @property
    def _key(self) -> bytes:
        return (self.token or "").encode()

    # ------------------------------------------------------------- control frames
    def seal(self, payload: bytes, binding: FrameBinding | None = None) -> bytes:
        """The frame to send: the payload, MAC'd with ``binding`` when there is a token (which then
        requires a binding)."""
        if self.token is None:
            return payload
        if binding is None:
            raise ValueError("binding: a frame sealed under a token says who sends it, to whom and when")
        head = binding.encode()
        body = struct.pack(">H", len(head)) + head + payload
        return FRAME_MAGIC + hmac.new(self._key, body, hashlib.sha256).digest() + body

    def open(self, frame: bytes, peer: str | None) -> tuple[FrameBinding | None, bytes]:
        """(binding, payload) of a received frame from ``peer`` (its IP address, when known); the
        binding is None without a token. AuthError when this server must not accept it; the
        caller checks the binding (``FrameGate``)."""
        sealed = frame[:len(FRAME_MAGIC)] == FRAME_MAGIC
        if self.token is None:
            if sealed:
                raise AuthError("the peer authenticates its frames but this server has no "
                                "--disaggregation-auth-token: configure the same token on both sides")
            self.check_peer(peer)
            return None, frame
        if not sealed:
            raise AuthError("frame without authentication (is --disaggregation-auth-token set on the peer, and "
                            "does it run this version?)")
        mac, body = frame[len(FRAME_MAGIC):len(FRAME_MAGIC) + MAC_BYTES], frame[len(FRAME_MAGIC) + MAC_BYTES:]
        if not hmac.compare_digest(mac, hmac.new(self._key, body, hashlib.sha256).digest()):
            raise AuthError("frame authentication failed (wrong token, or altered on the way)")
        (n,) = struct.unpack(">H", body[:2]) if len(body) >= 2 else (-1,)
        if not 0 <= n <= MAX_BINDING_BYTES or len(body) < 2 + n:
            raise AuthError("frame binding: malformed")
        return FrameBinding.decode(body[2:2 + n]), body[2 + n:]

    def check_peer(self, peer: str | None) -> None:
        """Without a token: loopback peers only, unless allowed."""
        if self.token is None and not self.allow_unauthenticated and not is_loopback(peer):
            raise AuthError(f"unauthenticated peer {peer or 'at an unknown address'} refused: only loopback "
                            f"peers are accepted without --disaggregation-auth-token "
                            f"(or pass --disaggregation-allow-unauthenticated)")

    # ------------------------------------------------------------- bootstrap HTTP
    def sign(self, method: str, path: str, body: bytes, target: str, now: float | None = None,
             nonce: str | None = None) -> dict:
        """Headers for a bootstrap request to the registry at ``target`` ("host:port", as the
        client names it); none without a token."""
        if self.token is None:
            return {}
        t = int(time.time() if now is None else now)
        n = nonce or secrets.token_hex(NONCE_HEX // 2)
        mac = self._mac(method, path, target, t, n, body)
        return {SIGNATURE_HEADER: f"t={t},n={n},target={target},mac={mac}"}

    def verify(self, method: str, path: str, body: bytes, header: str | None, peer: str | None,
               now: float | None = None) -> Signed | None:
        """The checked signature (None without a token, where the peer must be allowed instead);
        AuthError unless the request is signed with this token and fresh. Whether its ``target``
        is this registry, and whether its nonce was seen, is the registry's to check."""
        if self.token is None:
            self.check_peer(peer)
            return None
        if not header:
            raise AuthError(f"missing {SIGNATURE_HEADER} (is --disaggregation-auth-token set on the peer?)")
        parts = dict(p.partition("=")[::2] for p in header.split(",")[:4])
        t, n, target, mac = (parts.get(k, "") for k in ("t", "n", "target", "mac"))
        if not t.isdigit() or len(t) > 12:
            raise AuthError(f"{SIGNATURE_HEADER}: no timestamp")
        if len(n) != NONCE_HEX or not set(n) <= set("0123456789abcdef"):
            raise AuthError(f"{SIGNATURE_HEADER}: no nonce (is the peer of this version?)")
        if abs((time.time() if now is None else now) - int(t)) > MAX_CLOCK_SKEW_S:
            raise AuthError(f"{SIGNATURE_HEADER}: expired or clocks more than {MAX_CLOCK_SKEW_S:.0f} s apart")
        if not target or len(target) > 300:
            raise AuthError(f"{SIGNATURE_HEADER}: no target (is the peer of this version?)")
        if not hmac.compare_digest(mac.encode(), self._mac(method, path, target, int(t), n, body).encode()):
            raise AuthError("bootstrap request authentication failed (wrong token, or altered on the way)")
        return Signed(int(t), n, target)

    def sign_answer(self, nonce: str, status: int, body: bytes) -> dict:
        """Headers proving a registry's answer to the request that carried ``nonce``."""
        if self.token is None:
            return {}
        return {ANSWER_HEADER: f"mac={self._answer_mac(nonce, status, body)}"}

    def verify_answer(self, nonce: str, status: int, body: bytes, header: str | None) -> None:
        """AuthError unless a registry's answer proves the token (and answers this very request)."""
        mac = (header or "").partition("mac=")[2]
        if not hmac.compare_digest(mac.encode(), self._answer_mac(nonce, status, body).encode()):
            raise AuthError(f"answer without a valid {ANSWER_HEADER}: the registry does not hold this "
                            f"deployment's --disaggregation-auth-token")

    # ------------------------------------------------------------- routed bootstrap fields
    def sign_route(self, refs: list[tuple[str, int, int]], instance: str, now: float | None = None,
                   nonce: str | None = None, purpose: str = "route") -> str | None:
        """A router's ``bootstrap_signature`` over a request's (host, port, room) per prompt, for the
        decode server ``instance``; None without a token. ``purpose``: what the router asks with it
        ("route": act on these fields; "prefill-lost": prefill their rooms locally now)."""
        if self.token is None:
            return None
        exp = int(time.time() if now is None else now) + ROUTE_TTL_S
        n = nonce or secrets.token_hex(NONCE_HEX // 2)
        return f"e={exp},n={n},i={instance},mac={self._route_mac(refs, instance, exp, n, purpose)}"

    def verify_route(self, signature: str, refs: list[tuple[str, int, int]], instance: str,
                     now: float | None = None, purpose: str = "route") -> Signed:
        """The checked ``bootstrap_signature`` (its expiry as ``t``); AuthError unless it was made under
        this token for exactly these fields and this instance, and has not expired. The nonce's
        freshness is the caller's to check."""
        if self.token is None:
            raise AuthError("bootstrap_signature: this server has no --disaggregation-auth-token to check it with")
        parts = dict(p.partition("=")[::2] for p in signature.split(",")[:4])
        e, n, i, mac = (parts.get(k, "") for k in ("e", "n", "i", "mac"))
        if not e.isdigit() or len(e) > 12 or len(n) != NONCE_HEX or not set(n) <= set("0123456789abcdef"):
            raise AuthError("bootstrap_signature: malformed")
        if i != instance:
            raise Misdirected(f"bootstrap_signature: made for server instance {i[:40]!r}, this is {instance!r} (it "
                              "restarted since the router's last health check?)")
        now = time.time() if now is None else now
        if not now - MAX_CLOCK_SKEW_S <= int(e) <= now + ROUTE_TTL_S + MAX_CLOCK_SKEW_S:
            raise AuthError("bootstrap_signature: expired (or clocks more than "
                            f"{MAX_CLOCK_SKEW_S:.0f} s apart)")
        if not hmac.compare_digest(mac.encode(), self._route_mac(refs, instance, int(e), n, purpose).encode()):
            raise AuthError("bootstrap_signature: not valid for these bootstrap fields and this server (wrong "
                            "token, altered, or signed for another server)")
        return Signed(int(e), n, instance)

    def _route_mac(self, refs: list[tuple[str, int, int]], instance: str, exp: int, nonce: str,
                   purpose: str) -> str:
        fields = "".join(f"{host}\t{port}\t{room}\n" for host, port, room in refs)
        msg = f"{purpose}\n{instance}\n{exp}\n{nonce}\n{fields}".encode()
        return hmac.new(self._key, msg, hashlib.sha256).hexdigest()

    def _mac(self, method: str, path: str, target: str, t: int, nonce: str, body: bytes) -> str:
        msg = f"{method.upper()}\n{path}\n{target}\n{t}\n{nonce}\n".encode() + body
        return hmac.new(self._key, msg, hashlib.sha256).hexdigest()

    def _answer_mac(self, nonce: str, status: int, body: bytes) -> str:
        msg = f"answer\n{nonce}\n{status}\n".encode() + body
        return hmac.new(self._key, msg, hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class Signed:
    """What a verified bootstrap signature says: when, which nonce, for which registry."""

    t: int
    nonce: str
    target: str  # "host:port" as the client named the registry


class NonceCache:
    """Nonces seen within the clock-skew window, so that a signed request is accepted once.

    Bounded: past ``capacity`` the earliest seen is forgotten and its time becomes a floor; a
    request signed at or before the floor is refused, since its nonce may be one forgotten."""

    def __init__(self, capacity: int = MAX_NONCES, window_s: float = MAX_CLOCK_SKEW_S):
        self.capacity, self.window_s = capacity, window_s
        self._seen: OrderedDict[str, float] = OrderedDict()  # nonce -> the time it was signed, in arrival order
        self._floor = -math.inf

    def __len__(self) -> int:
        return len(self._seen)

    def add(self, nonce: str, t: float, now: float | None = None) -> bool:
        """True the first time ``nonce`` (signed at ``t``) is seen; False for a replay."""
        now = time.time() if now is None else now
        while self._seen and next(iter(self._seen.values())) < now - self.window_s:
            self._seen.popitem(last=False)  # expired: the clock check refuses it now anyway
        if nonce in self._seen or t <= self._floor:
            return False
        while len(self._seen) >= self.capacity:
            self._floor = max(self._floor, self._seen.popitem(last=False)[1])
        self._seen[nonce] = t
        return True


@dataclass(frozen=True)
class FrameBinding:
    """Who sent a control frame (``sender``: its session), to whom (``destination``: the endpoint it
    was sent to), its place in the sender's sequence, and when (unix milliseconds)."""

    sender: str
    destination: str
    seq: int
    t_ms: int

    def encode(self) -> bytes:
        return f"{self.sender}\n{self.destination}\n{self.seq}\n{self.t_ms}".encode()

    @classmethod
    def decode(cls, data: bytes) -> FrameBinding:
        try:
            sender, destination, seq, t_ms = data.decode().split("\n")
        except (UnicodeDecodeError, ValueError):
            raise AuthError("frame binding: malformed") from None
        if not (seq.isdigit() and t_ms.isdigit() and len(seq) <= 20 and len(t_ms) <= 16 and sender):
            raise AuthError("frame binding: malformed")
        return cls(sender, destination, int(seq), int(t_ms))


class SequenceGuard:
    """A receiver's memory of control-frame senders: the last sequence number each used. Frames
    from one sender to one endpoint arrive in order (one ZMQ connection), so a number not above
    the last is a replay. Bounded like ``NonceCache``: a forgotten sender's last time becomes a
    floor for senders not remembered."""

    def __init__(self, capacity: int = MAX_SENDERS):
        self.capacity = capacity
        self._last: OrderedDict[str, tuple[int, int]] = OrderedDict()  # sender -> (seq, t_ms), least recent first
        self._floor_ms = -1

    def add(self, b: FrameBinding) -> bool:
        """True (and remembered) when ``b`` is new from its sender; False for a replay."""
        last = self._last.get(b.sender)
        if (last is not None and b.seq <= last[0]) or (last is None and b.t_ms <= self._floor_ms):
            return False
        self._last.pop(b.sender, None)
        while len(self._last) >= self.capacity:
            self._floor_ms = max(self._floor_ms, self._last.popitem(last=False)[1][1])
        self._last[b.sender] = (b.seq, b.t_ms)
        return True
