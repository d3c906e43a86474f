"""Argument types of the command line: each turns a flag's text into a checked value or a
one-line error naming what was wrong, before anything starts."""
from __future__ import annotations

import argparse


def parse_bytes(text: str) -> int:
    """'8G', '512M', '1.5GiB', '1000000' -> bytes (binary units)."""
    units = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = t[-1] if t and t[-1] in units else ""
    try:
        value = float(t[:-1] if unit else t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--max-memory: {text!r} is not a size like 8G or 512M") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"--max-memory must be > 0 (got {text!r})")
    return int(value * units[unit])


def memory_arg(text: str) -> str:
    parse_bytes(text)
    return text


def slowdown_arg(text: str) -> float:
    value = nonneg_float(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 (1: full speed; got {value})")
    return value


def stage_arg(text: str) -> str | int:
    return text if text == "auto" else nonneg_int(text, "must be 'auto' or a stage index")


def nonneg_int(text: str, what: str = "must be an integer") -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{what}, not {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (got {value})")
    return value


def port_arg(text: str) -> int:
    value = nonneg_int(text, "must be a port number")
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be a port in 0..65535 (got {value})")
    return value


def nonneg_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, not {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0 (got {value})")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, not {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0 (got {value})")
    return value


def fraction_arg(text: str) -> float:
    value = nonneg_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"must be a fraction in 0..1 (got {value})")
    return value


def duration_arg(text: str) -> float:
    from swarmgrad.peer.private.credentials import parse_duration
    try:
        return parse_duration(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def address_arg(text: str) -> str:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT")
    return text


def positive_int(text: str) -> int:
    value = nonneg_int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be >= 1")
    return value
