"""What signing round boundaries costs (peer/net/round_tickets.py): per request against per round.

A driver's round ticket could be signed for every request (with a nonce) or once per round (what
swarmgrad does: a ticket states a fact, so replaying it is harmless). This prints the CPU time of
each piece on this machine, so the choice can be read off:

- sign: one Ed25519 signature (the driver, once per round; per request it would be every microbatch);
- verify: one check against the driver's peer id (a later stage, once per (driver, round); per
  request it would be every microbatch at every stage);
- cached verify / cached ticket: what every other request of the round costs.

    python -m benchmarks.round_tickets
"""
from __future__ import annotations

import argparse
import time

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from swarmgrad.peer.net.identity import peer_id_of
from swarmgrad.peer.net.round_tickets import RoundSigner, VerifiedTickets, ticket_refusal


def measure(n: int) -> dict[str, float]:
    """Microseconds per operation, each the mean of `n`."""
    key = Ed25519PrivateKey.generate()
    driver = peer_id_of(key)
    signer = RoundSigner(key, "run", "h" * 32)

    def timed(fn) -> float:  # type: ignore[no-untyped-def]
        started = time.perf_counter()
        for i in range(n):
            fn(i)
        return (time.perf_counter() - started) / n * 1e6

    ticket = signer.ticket(0)
    verified = VerifiedTickets("run", "h" * 32)
    verified.refusal(driver, 0, ticket)
    return {"sign_us": timed(signer.ticket),
            "verify_us": timed(lambda _: ticket_refusal(driver, 0, ticket, "run", "h" * 32)),
            "cached_verify_us": timed(lambda _: verified.refusal(driver, 0, ticket)),
            "cached_ticket_us": timed(lambda _: signer.ticket(7))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", type=int, default=2000, help="operations per figure")
    for name, us in measure(parser.parse_args().n).items():
        print(f"{name:18s} {us:9.2f}")


if __name__ == "__main__":
    main()
