"""Which bootstrap fields a decode server acts on (docs/security.md, "Bootstrap fields").

``bootstrap_host``/``bootstrap_port`` name the registry decode fetches a request's prefill records
from (and sends its KV requests, with its own records, to). Taken from anyone, they would let an API
client point decode at any host and port (server-side request forgery, port probing by timing). So:

- signed: the router holding the deployment's P/D token signs the fields (``PeerAuth.sign_route``:
  every (host, port, room), this server's instance, an expiry, a nonce); decode accepts a valid
  signature once (``NonceCache``). A signature for another instance (this server restarted since the
  router's last health check) is ``Misdirected``: the router checks again and resends.
- unsigned (sglang-router cannot sign, a client calls decode itself): each (host, port) must be in
  ``--disaggregation-bootstrap-allow``, or, on a server without a token, on the loopback (a
  one-host deployment, ``pdserve up``). Anything else is refused, naming the field.
"""

from __future__ import annotations

import secrets

from pdserve.disagg.auth import MAX_CLOCK_SKEW_S, ROUTE_TTL_S, AuthError, NonceCache, PeerAuth, is_loopback

Ref = tuple[str, int, int]  # (host without brackets, port, room)


def parse_endpoint(value: str) -> tuple[str, int]:
    """``HOST:PORT`` (IPv6 in brackets) -> (host without brackets, port); ValueError naming the value."""
    host, sep, port = value.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{value!r} is not HOST:PORT")
    return host, int(port)


def route_refs(body: dict) -> list[Ref]:
    """The (host, port, room) of each prompt of a body ``bootstrap.with_bootstrap`` made, as decode
    reads them (``entrypoints/protocol.py``: hosts without brackets)."""
    host, port, room = body["bootstrap_host"], body["bootstrap_port"], body["bootstrap_room"]
    if not isinstance(room, list):
        return [(host.strip("[]"), port, room)]
    return [(h.strip("[]"), p, r) for h, p, r in zip(host, port, room)]


class BootstrapGate:
    """A decode server's check of the bootstrap fields of each request (its frontend, one per server)."""

    def __init__(self, auth: PeerAuth, allow: tuple[str, ...] = (), instance: str | None = None):
        self.auth = auth
        self.allow = frozenset(parse_endpoint(a) for a in allow)
        self.instance = instance or secrets.token_hex(8)  # named on /health: what the router signs for
        self.nonces = NonceCache(window_s=ROUTE_TTL_S + 2 * MAX_CLOCK_SKEW_S)

    def check(self, refs: list[Ref], signature: str | None, now: float | None = None) -> None:
        """AuthError (``Misdirected`` for another instance) unless decode may act on ``refs``."""
        if signature is not None:
            signed = self.auth.verify_route(signature, refs, self.instance, now)
            if not self.nonces.add(signed.nonce, signed.t, now):
                raise AuthError("bootstrap_signature: already used (a replayed request)")
            return
        for host, port, _ in refs:
            if (host, port) in self.allow:
                continue
            if self.auth.token is None and is_loopback(host):
                continue
            why = ("not signed by the router (this server has a --disaggregation-auth-token: give the router the "
                   "same token)" if self.auth.token is not None else "not on the loopback")
            raise AuthError(f"bootstrap_host: {host}:{port} is {why} and not in --disaggregation-bootstrap-allow")

    def check_lost(self, refs: list[Ref], signature: str | None, peer: str | None, now: float | None = None) -> None:
        """AuthError unless the router may tell this server that the prefill halves of ``refs``
        broke (``purpose`` "prefill-lost", signed under the token; without one, from the loopback)."""
        if self.auth.token is None:
            if not is_loopback(peer):
                raise AuthError(f"signature: a report from {peer or 'an unknown address'} must be signed (this server "
                                "has no --disaggregation-auth-token: loopback only)")
            return
        if signature is None:
            raise AuthError("signature: required (this server has a --disaggregation-auth-token)")
        signed = self.auth.verify_route(signature, refs, self.instance, now, purpose="prefill-lost")
        if not self.nonces.add(signed.nonce, signed.t, now):
            raise AuthError("signature: already used (a replayed report)")
