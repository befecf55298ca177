"""Challenge-response authentication between the scheduler's clients and services (protocol 2).

No secret ever travels: neither the service token nor a job's secret is sent, in either
direction, so whoever listens on the service's port or Ray name while the service is down
(any local user can bind a free loopback port) learns nothing it can reuse. Each connection
(each Ray session) opens with a handshake in which the service proves first:

    client  -> {"op": "hello", "nonce": C, "job": J}                 (J only when the client
                                                                      holds J's secret, not the token)
    service -> {"ok": true, "protocol": 2, "nonce": S, "proof": HMAC(K, "service", S, C)}
    client     checks the proof (hmac.compare_digest) before it sends anything else
    client  -> every message then carries token_proof = HMAC(token, "client", S, C), or
               secret_proof = HMAC(secret of its job, "client", S, C), never the key itself

K is the token, or J's secret when the hello names J. C and S are fresh random nonces of 16
bytes, so a proof is good on its own connection only: a proof an impostor collects (by
playing the service) names its own S and a real service never issues that S. The two roles
are in the HMAC's input, so a service's proof is never a client's. A service with no token
(a Ray actor reached only from its cluster) answers "proof": null to a hello without J, and a
client that holds a token refuses to go on with it.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from rlcu.sched.protocol import NONCE, PROTOCOL, SchedError, raise_for


def nonce() -> str:
    return secrets.token_hex(16)


def proof(key: str, role: str, snonce: str, cnonce: str) -> str:
    """HMAC-SHA256(key, role S C) as hex; role "service" or "client"."""
    msg = f"rlcu-sched/{PROTOCOL} {role}\n{snonce}\n{cnonce}".encode()
    return hmac.digest(key.encode(), msg, hashlib.sha256).hex()


def same(given, expected: str) -> bool:
    """Constant-time comparison of a proof a peer gave with the one expected."""
    return isinstance(given, str) and hmac.compare_digest(given.encode(), expected.encode())


class Handshake:
    """The client's side of one connection or Ray session: the hello to send, the check of
    the service's answer, and the proofs that then stand in for the token and secrets.

        hs = Handshake(msg, token)            # msg: the first message to go (its token or secret picks K)
        reply = send(hs.hello)
        hs.accept(reply, where)               # SchedError "auth" unless the service proved K
        wire = hs.sign(msg)                   # token / secret replaced by their proofs
    """

    __slots__ = ("cnonce", "job", "key", "proofs", "snonce")

    def __init__(self, msg: dict, token: str | None):
        self.cnonce, self.snonce = nonce(), None
        sec = msg.get("secret")
        self.job = msg.get("job") if sec is not None else None
        self.key = sec if sec is not None else msg.get("token", token)
        self.proofs: dict[str, str] = {}

    @property
    def hello(self) -> dict:
        return {"op": "hello", "nonce": self.cnonce, **({"job": self.job} if self.job is not None else {})}

    def accept(self, reply, where: str) -> None:
        """Take the service's answer to the hello; raises SchedError (from protocol) when it
        is an error reply, or does not prove that the service knows the key."""
        raise_for(reply)
        s = reply.get("nonce")
        if not isinstance(s, str) or not NONCE.match(s):
            raise SchedError(f"the scheduler at {where} answered the hello without a nonce: it speaks another "
                             f"protocol than this client's ({PROTOCOL}; upgrade rlcu on one side)", "protocol")
        if self.key is not None and not same(reply.get("proof"), proof(self.key, "service", s, self.cnonce)):
            why = (f"the secret given is not job {self.job!r}'s (the one `register` returned)" if self.job is not None
                   else "the token differs (see <state>/token, --token-file or $RLCU_SCHED_TOKEN)")
            raise SchedError(f"whatever answers at {where} did not prove it knows the key: {why}, or it is not the "
                             "scheduler (another process on its address?); nothing secret was sent", "auth")
        self.snonce = s

    def sign(self, msg: dict) -> dict:
        """`msg` as it goes on the wire: its token or secret replaced by the proof of it."""
        out = {k: v for k, v in msg.items() if k not in ("token", "secret")}
        key, field = (msg["secret"], "secret_proof") if "secret" in msg else (msg.get("token"), "token_proof")
        if key is not None:
            p = self.proofs.get(key)
            if p is None:
                if len(self.proofs) >= 64:  # (a client acting for many jobs on one connection)
                    self.proofs.clear()
                p = self.proofs[key] = proof(key, "client", self.snonce, self.cnonce)
            out[field] = p
        return out
