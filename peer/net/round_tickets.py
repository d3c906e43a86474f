"""Round tickets: a driver's signature that it has entered a round, the only thing that may end a
later stage's round early.

A later stage (≥ 1) ends its round when a microbatch of a later round arrives (decisions.round_ended),
so the `round` of a forward request moves the stage's clock. Named by the request's `driver` field
alone, anyone who can reach a replica could cut its rounds short, one round per request, until it
trains without ever averaging with its group. So a request of a later round than the replica's must
carry a *ticket*: the Ed25519 signature, by the key whose public half is the driver's peer id
(identity.public_key_of), over (run id, manifest hash, round) under DOMAIN. The stage server checks it
before the round has any effect (peer/pipeline/stage_server.py), besides the existing checks (the
driver is listed at stage 0; at most one round ahead).

Why per round and not per request: a ticket states a fact about the driver ("I am in round r"), so
replaying it says nothing false. A replica that relays a request downstream relays its ticket
unchanged (a ticket names no stage), a stranger that copies one can only end rounds the driver
really ended, and a ticket of round r cannot move anyone to r + 1. A per-request nonce would add a
signature to every microbatch (and a verification at every stage) for no gain. The driver signs
once per round; a server verifies a (driver, round) once and remembers it (VerifiedTickets),
and only for a request whose round is ahead of its own (the only case in which the round matters).
Measured: docs/trust.md, "Round boundaries".

Pure crypto over bytes; no network.
"""
from __future__ import annotations

from collections import OrderedDict

import msgpack
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from swarmgrad.peer.net.identity import peer_id_of, public_key_of

DOMAIN = b"swarmgrad/round-ticket/v1\x00"
"""Prefix of every signed ticket, so a ticket means nothing in another protocol (DHT records sign
under their own tag)."""
VERIFIED_KEPT = 64
"""(driver, round) pairs a server remembers as verified: a few drivers times a couple of rounds."""


def ticket_message(run_id: str, manifest_hash: str, round_no: int) -> bytes:
    """What a ticket signs. The run and manifest hash keep a ticket from another run (or an old
    manifest of the same run) from counting here."""
    return DOMAIN + msgpack.packb([run_id, manifest_hash, int(round_no)], use_bin_type=True)


class RoundSigner:
    """A driver's tickets: one signature per round, kept until the next round's."""

    def __init__(self, key: Ed25519PrivateKey, run_id: str, manifest_hash: str):
        self._key = key
        self.peer_id = peer_id_of(key)
        self.run_id = run_id
        self.manifest_hash = manifest_hash
        self._last: tuple[int, bytes] | None = None
        self.signed = 0
        """Signatures made (one per round the driver sent a microbatch in)."""

    def ticket(self, round_no: int) -> bytes:
        if self._last is None or self._last[0] != round_no:
            self._last = (round_no, self._key.sign(ticket_message(self.run_id, self.manifest_hash, round_no)))
            self.signed += 1
        return self._last[1]


def ticket_refusal(driver: str, round_no: int, ticket: bytes, run_id: str, manifest_hash: str) -> str | None:
    """Why `ticket` does not show that `driver` is in `round_no` (None: it does). Never raises."""
    if not ticket:
        return "carries no round ticket"
    try:
        key = public_key_of(driver)
    except ValueError:
        return "names a driver that is not an Ed25519 peer id"
    try:
        key.verify(ticket, ticket_message(run_id, manifest_hash, round_no))
    except InvalidSignature:
        return f"carries a round ticket that {driver[-8:]} did not sign for round {round_no}"
    return None


class VerifiedTickets:
    """A stage server's check of round tickets, remembering the (driver, round) pairs that verified
    (the driver's later requests of that round carry the same ticket: one verification each)."""

    def __init__(self, run_id: str, manifest_hash: str, keep: int = VERIFIED_KEPT):
        self.run_id = run_id
        self.manifest_hash = manifest_hash
        self.keep = keep
        self._ok: OrderedDict[tuple[str, int, bytes], None] = OrderedDict()
        self.verified = 0
        """Signature verifications run (not answered from memory)."""

    def refusal(self, driver: str, round_no: int, ticket: bytes) -> str | None:
        key = (driver, round_no, ticket)
        if key in self._ok:
            self._ok.move_to_end(key)
            return None
        self.verified += 1
        reason = ticket_refusal(driver, round_no, ticket, self.run_id, self.manifest_hash)
        if reason is None:
            self._ok[key] = None
            while len(self._ok) > self.keep:
                self._ok.popitem(last=False)
        return reason
