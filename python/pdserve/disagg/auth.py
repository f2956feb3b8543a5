"""Who may talk to a server's P/D ports (bootstrap registry, control channel): docs/disaggregation.md,
"The trust boundary".

With a shared token (``--disaggregation-auth-token``, ``--disaggregation-auth-token-file`` or
``PDSERVE_DISAGGREGATION_AUTH_TOKEN``: ``config.resolve_token``; the same on every prefill and decode server of a
deployment), every control frame carries an HMAC-SHA256 of its bytes under the token, and every
bootstrap request an HMAC of its method, path, timestamp and body: the token itself never
crosses the network, and a frame altered on the way is refused. Without a token, only loopback
peers are accepted, unless the operator says ``--disaggregation-allow-unauthenticated`` (a
private network they trust).

What an HMAC does not give: secrecy (KV bytes and messages travel in clear; RDMA and the
transfer engine are outside this), nor protection from a replayed control frame (its room and
nonce make a replay a duplicate, refused as one). Bootstrap signatures expire after
``MAX_CLOCK_SKEW_S``.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import time
from dataclasses import dataclass, field

FRAME_MAGIC = b"PDA1"  # an authenticated control frame: magic, 32-byte MAC, payload
MAC_BYTES = 32
SIGNATURE_HEADER = "X-PDServe-Signature"  # bootstrap: "t=<unix seconds>,mac=<hex>"
MAX_CLOCK_SKEW_S = 300.0


def peer_auth(cfg) -> PeerAuth:
    """A server's rule from its ``config.DisaggConfig``."""
    return PeerAuth(cfg.auth_token, cfg.allow_unauthenticated)


class AuthError(ValueError):
    """A peer's frame or request is not accepted; the text says why (never the token)."""


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
    def seal(self, payload: bytes) -> bytes:
        """The frame to send: the payload, MAC'd when there is a token."""
        if self.token is None:
            return payload
        return FRAME_MAGIC + hmac.new(self._key, payload, hashlib.sha256).digest() + payload

    def open(self, frame: bytes, peer: str | None) -> bytes:
        """The payload of a received frame from ``peer`` (its IP address, when known); AuthError
        when this server must not accept it."""
        sealed = frame[:len(FRAME_MAGIC)] == FRAME_MAGIC
        if self.token is None:
            if sealed:
                raise AuthError("the peer authenticates its frames but this server has no "
                                "--disaggregation-auth-token: configure the same token on both sides")
            self.check_peer(peer)
            return frame
        if not sealed:
            raise AuthError("frame without authentication (is --disaggregation-auth-token set on the peer?)")
        mac, payload = frame[len(FRAME_MAGIC):len(FRAME_MAGIC) + MAC_BYTES], frame[len(FRAME_MAGIC) + MAC_BYTES:]
        if not hmac.compare_digest(mac, hmac.new(self._key, payload, hashlib.sha256).digest()):
            raise AuthError("frame authentication failed (wrong token, or altered on the way)")
        return payload

    def check_peer(self, peer: str | None) -> None:
        """Without a token: loopback peers only, unless allowed."""
        if self.token is None and not self.allow_unauthenticated and not is_loopback(peer):
            raise AuthError(f"unauthenticated peer {peer or 'at an unknown address'} refused: only loopback "
                            f"peers are accepted without --disaggregation-auth-token "
                            f"(or pass --disaggregation-allow-unauthenticated)")

    # ------------------------------------------------------------- bootstrap HTTP
    def sign(self, method: str, path: str, body: bytes, now: float | None = None) -> dict:
        """Headers for a bootstrap request (none without a token)."""
        if self.token is None:
            return {}
        t = int(time.time() if now is None else now)
        return {SIGNATURE_HEADER: f"t={t},mac={self._mac(method, path, t, body)}"}

    def verify(self, method: str, path: str, body: bytes, header: str | None, peer: str | None,
               now: float | None = None) -> None:
        """AuthError unless the bootstrap request is signed with this token (or, with none, the
        peer is allowed)."""
        if self.token is None:
            self.check_peer(peer)
            return
        if not header:
            raise AuthError(f"missing {SIGNATURE_HEADER} (is --disaggregation-auth-token set on the peer?)")
        parts = dict(p.partition("=")[::2] for p in header.split(","))
        t, mac = parts.get("t", ""), parts.get("mac", "")
        if not t.isdigit() or len(t) > 12:
            raise AuthError(f"{SIGNATURE_HEADER}: no timestamp")
        if abs((time.time() if now is None else now) - int(t)) > MAX_CLOCK_SKEW_S:
            raise AuthError(f"{SIGNATURE_HEADER}: expired or clocks more than {MAX_CLOCK_SKEW_S:.0f} s apart")
        if not hmac.compare_digest(mac.encode(), self._mac(method, path, int(t), body).encode()):
            raise AuthError("bootstrap request authentication failed (wrong token, or altered on the way)")

    def _mac(self, method: str, path: str, t: int, body: bytes) -> str:
        msg = f"{method.upper()}\n{path}\n{t}\n".encode() + body
        return hmac.new(self._key, msg, hashlib.sha256).hexdigest()
