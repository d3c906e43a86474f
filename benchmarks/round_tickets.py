"""What signing round boundaries costs (peer/net/round_tickets.py): per request against per round.

A driver's round ticket could be signed for every request (with a nonce) or once per round (what
swarmgrad does: a ticket states a fact, so replaying it is harmless). This prints the CPU time of
each piece on this machine, so the choice can be read off:

- sign: one Ed25519 signature (the driver, once per round; per request it would be every microbatch);
- verify: one check against the driver's peer id (a later stage, once per (driver, round); per
  request it would be every microbatch at every stage);
- cached verify / cached ticket: what every other request of the round costs.

    python -m benchmarks.round_tickets            # 2000 operations per figure
    python -m benchmarks.round_tickets --quick
"""
from __future__ import annotations

import argparse
import sys
import time

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from benchmarks.harness.report import Report, add_common_args
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser, quick="200 operations per figure instead of 2000",
                    seed="unused: the keys are fresh each run (the flag is common to every benchmark)")
    parser.add_argument("-n", type=int, default=None, help="operations per figure (default 2000; 200 with --quick)")
    args = parser.parse_args()
    n = args.n or (200 if args.quick else 2000)
    report = Report("What a driver's round ticket costs", args.out)
    figures = measure(n)
    report.table(["operation", "µs"], [[name, f"{us:.2f}"] for name, us in figures.items()])
    report.results = {"n": n, **figures}
    report.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
