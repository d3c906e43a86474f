"""Validation of values other peers store in the DHT: stage records and round registrations.

The DHT hands back whatever its writers stored (signed, but a signature only says who wrote
it). These pure functions bound every field before peer code believes it: a record with a
non-finite throughput, a round beyond any real run, or a megabyte of addresses is refused
with a reason, and the caller drops it (peer/net/dht_view.py reads the DHT and calls them).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from swarmgrad.protocol import wire_pb2 as pb
from swarmgrad.protocol.framing import ProtocolError
from swarmgrad.protocol.validation import MAX_ID_CHARS, MAX_ROUND

MAX_WEIGHT = 1e9
"""Samples one replica can claim for one round (a weight is a count of samples trained)."""
MAX_THROUGHPUT = 1e6
"""Microbatches per second one replica can claim."""
MAX_STAGE = 1 << 16
MAX_MADDRS = 8
MAX_MADDR_CHARS = 256
MAX_STATE_CHARS = 32
MAX_MEMORY = 1 << 50
"""Bytes a peer may offer: a petabyte is no device's."""
MAX_BACKUPS = 16
"""(stage, applied_rounds) pairs one record may list: a holder keeps one copy per stage, and a
record is read by every peer's placement, so it stays small whatever the writer claims."""
MAX_VOUCHER_BYTES = 512
"""A record's optional `voucher` (peer/net/vouchers.py, which checks what it says)."""


def _fail(what: str, reason: str) -> ProtocolError:
    return ProtocolError(pb.BAD_REQUEST, f"{what}: {reason}")


def _int(value: Any, lo: int, hi: int, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise _fail(what, f"must be an int in [{lo}, {hi}], got {str(value)[:32]}")
    return int(value)


def _float(value: Any, lo: float, hi: float, what: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise _fail(what, f"must be a number, got {type(value).__name__}")
    try:
        number = float(value)
    except OverflowError:  # an int too large for a float
        raise _fail(what, "out of range") from None
    if not (math.isfinite(number) and lo <= number <= hi):
        raise _fail(what, f"must be finite and in [{lo}, {hi}], got {number}")
    return number


def _bool(value: Any, what: str) -> bool:
    if not isinstance(value, bool):
        raise _fail(what, f"must be a bool, got {type(value).__name__}")
    return value


def _str(value: Any, max_chars: int, what: str, allow_empty: bool = False) -> str:
    if not isinstance(value, str) or len(value) > max_chars or (not value and not allow_empty):
        raise _fail(what, f"must be a {'' if allow_empty else 'non-empty '}str of at most {max_chars} characters")
    return value


@dataclass(frozen=True)
class Registration:
    """One replica's registration for an averaging round."""
    digest: str
    applied_rounds: int
    weight: float

    def to_value(self) -> dict[str, Any]:
        return {"digest": self.digest, "applied_rounds": self.applied_rounds, "weight": self.weight}


def validate_registration(value: Any, *, max_weight: float = MAX_WEIGHT) -> Registration:
    """A round registration read from the DHT, checked: a dict with a str `digest` of at most
    MAX_ID_CHARS characters, an int `applied_rounds` in [0, MAX_ROUND] and a finite `weight` in
    [0, max_weight] (a registration without weight counts as 0). Raises ProtocolError(BAD_REQUEST)."""
    if not isinstance(value, Mapping):
        raise _fail("registration", f"must be a dict, got {type(value).__name__}")
    return Registration(digest=_str(value.get("digest"), MAX_ID_CHARS, "registration digest"),
                        applied_rounds=_int(value.get("applied_rounds"), 0, MAX_ROUND, "registration applied_rounds"),
                        weight=_float(value.get("weight", 0.0), 0.0, max_weight, "registration weight"))


def bounded_record_fields(value: Any, *, max_throughput: float = MAX_THROUGHPUT,
                          max_stage: int = MAX_STAGE) -> dict[str, Any]:
    """The fields of a PeerRecord-like dict (peer/net/dht_view.py), checked and normalised.

    stage: int in [0, max_stage]; state: str of at most MAX_STATE_CHARS; throughput: finite, in
    [0, max_throughput]; round, applied_rounds: int in [0, MAX_ROUND]; digest, manifest_hash:
    str of at most MAX_ID_CHARS; driver: bool; maddrs (optional): a list of at most MAX_MADDRS
    str of at most MAX_MADDR_CHARS each; stats (optional): see _stats; backups (optional): see _backups; voucher (optional): see _voucher. Returns a new dict with exactly these keys; raises
    ProtocolError(BAD_REQUEST) naming the first bad field. Whether `state` is a known state and
    the manifest hash ours stay the caller's checks.
    """
    if not isinstance(value, Mapping):
        raise _fail("record", f"must be a dict, got {type(value).__name__}")
    maddrs = value.get("maddrs", ())
    if not isinstance(maddrs, (list, tuple)) or len(maddrs) > MAX_MADDRS:
        raise _fail("record maddrs", f"must be a list of at most {MAX_MADDRS} addresses")
    driver = value.get("driver")
    if not isinstance(driver, bool):
        raise _fail("record driver", "must be a bool")
    return {
        "stage": _int(value.get("stage"), 0, max_stage, "record stage"),
        "state": _str(value.get("state"), MAX_STATE_CHARS, "record state"),
        "throughput": _float(value.get("throughput"), 0.0, max_throughput, "record throughput"),
        "round": _int(value.get("round"), 0, MAX_ROUND, "record round"),
        "applied_rounds": _int(value.get("applied_rounds"), 0, MAX_ROUND, "record applied_rounds"),
        "digest": _str(value.get("digest"), MAX_ID_CHARS, "record digest", allow_empty=True),
        "manifest_hash": _str(value.get("manifest_hash"), MAX_ID_CHARS, "record manifest_hash"),
        "driver": driver,
        "maddrs": [_str(m, MAX_MADDR_CHARS, "record maddr") for m in maddrs],
        "memory": _int(value.get("memory", 0), 0, MAX_MEMORY, "record memory"),
        "moving": _bool(value.get("moving", False), "record moving"),
        "pinned": _bool(value.get("pinned", False), "record pinned"),
        "stats": _stats(value.get("stats")),
        "backups": _backups(value.get("backups", ()), max_stage),
        "voucher": _voucher(value.get("voucher", b"")),
    }


def _voucher(value: Any) -> bytes:
    """A record's optional `voucher`: bytes, at most MAX_VOUCHER_BYTES (whether it holds is the
    reader's check, peer/net/vouchers.py)."""
    if not isinstance(value, bytes) or len(value) > MAX_VOUCHER_BYTES:
        raise _fail("record voucher", f"must be bytes, at most {MAX_VOUCHER_BYTES}")
    return value


def _backups(value: Any, max_stage: int) -> tuple[tuple[int, int], ...]:
    """A record's optional `backups`: the copies its peer holds (peer/state/backup.py), a list of at
    most MAX_BACKUPS [stage, applied_rounds] pairs, stages distinct; sorted by stage."""
    if not isinstance(value, (list, tuple)) or len(value) > MAX_BACKUPS:
        raise _fail("record backups", f"must be a list of at most {MAX_BACKUPS} [stage, applied_rounds] pairs")
    pairs = []
    for item in value:
        if not isinstance(item, (list, tuple)) or len(item) != 2:
            raise _fail("record backups", "each entry must be a [stage, applied_rounds] pair")
        pairs.append((_int(item[0], 0, max_stage, "record backups stage"),
                      _int(item[1], 0, MAX_ROUND, "record backups applied_rounds")))
    if len({s for s, _ in pairs}) != len(pairs):
        raise _fail("record backups", "a stage is listed twice")
    return tuple(sorted(pairs))


STATS_BOUNDS = {"train_loss": 1e6, "val_loss": 1e6, "val_nats": 1e6, "val_ppl": 1e300, "round_s": 1e7, "group_size": 1e6, "samples_per_s": 1e9,
                "samples": 1e15, "bytes_sent": 1e18, "bytes_activations": 1e18, "bytes_gradients": 1e18,
                "bytes_averaging": 1e18, "bytes_state": 1e18}
"""The fields of a record's `stats` and the largest value each may have (all >= 0)."""


def _stats(value: Any) -> dict[str, Any] | None:
    """A record's optional `stats`: a dict of known fields, each None or a finite number in
    [0, bound]; unknown fields are dropped (a newer peer may say more)."""
    if value is None:
        return None
    if not isinstance(value, Mapping) or len(value) > 32:
        raise _fail("record stats", "must be a dict of at most 32 fields")
    out: dict[str, Any] = {}
    for name, bound in STATS_BOUNDS.items():
        field_value = value.get(name)
        out[name] = None if field_value is None else _float(field_value, 0.0, bound, f"record stats {name}")
    return out
