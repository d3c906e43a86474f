"""swarmgrad codecs vs hivemind's, side by side on the same tensors, one CPU core.

    python -m benchmarks.codecs [--sizes 1M,16M,64M] [--quick] [--speed-only] [--repeats 9] [--seed N] [--out DIR]

Columns: ratio = fp32 bytes / wire bytes (payload only for swarmgrad; hivemind's serialized
buffer, which includes its own small header), rel L2 error, encode / decode throughput in GB/s
of fp32 input (best of 3). Distributions: standard normal and Student-t (df=2, heavy tails).

int8 speed per core (printed after the table; ``--speed-only`` prints just that): GB/s = fp32
input bytes (4 * numel) / the best CPU time of the thread (and, in brackets, the best wall time)
of one encode followed by one decode, one torch thread, for 16M and 64M values of N(0, 1). CPU
time because the machine is shared: wall time counts the time other processes hold the core;
page faults of fresh outputs are CPU time of the thread and count. Paths run interleaved (one
repetition of each in turn, after one untimed warm-up) so machine load hits all alike. In the
same run: the int8 codec as it was before issue 45 (benchmarks/harness/int8_legacy.py, the same wire
bytes: checked), a memcpy of the same fp32 bytes into a reused buffer (the ceiling), and
``x.to(torch.float16)`` (fresh output).
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from benchmarks.harness.report import Report, add_common_args, seed_or
from swarmgrad.compression import decode, get_codec

SWARMGRAD_SPECS = [
    "fp16", "bf16", "int8", "int4", "topk:fraction=0.01,values=fp16", "topk:fraction=0.01,values=int8",
    "powersgd:rank=4",
]
QUANTILE_MAX_NUMEL = 16 * 2**20  # hivemind's Quantile8Bit takes ~3 s per 16M values
SPEED_SIZES = ("16M", "64M")


@dataclass
class Row:
    codec: str
    size: str
    dist: str
    ratio: float
    err: float
    enc: float
    dec: float


def patch_quantization_for_numpy24() -> None:
    """hivemind 1.1.12's 8-bit extract breaks on numpy>=2.4 (TypeError); benchmark-only fix."""
    from hivemind.compression import quantization as q

    def _extract(self, serialized_tensor):
        buf = serialized_tensor.buffer
        n_codes = int(np.frombuffer(buf, count=1, dtype=np.int64)[0])
        codebook = np.frombuffer(buf, offset=8, count=n_codes, dtype=self.codebook_dtype)
        indices = np.frombuffer(buf, offset=8 + codebook.nbytes, dtype=self.indices_dtype)
        indices = torch.as_tensor(indices, dtype=torch.int64).reshape(tuple(serialized_tensor.size))
        codebook = torch.as_tensor(codebook).to(dtype=getattr(torch, serialized_tensor.dtype))
        return codebook[indices].requires_grad_(serialized_tensor.requires_grad)

    q.Quantization.extract = _extract


def hivemind_codecs() -> tuple[dict[str, Callable], list[str]]:
    """name -> (encode(t) -> message, decode(message) -> t, nbytes(message)); and notes."""
    notes: list[str] = []
    try:
        from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
        from hivemind.proto.runtime_pb2 import CompressionType
    except Exception as exc:  # noqa: BLE001 - report any import failure
        return {}, [f"hivemind unavailable: {exc!r}"]
    patch_quantization_for_numpy24()
    out = {}
    for name, ctype in [("hm:Float16", "FLOAT16"), ("hm:Uniform8Bit", "UNIFORM_8BIT"),
                        ("hm:Quantile8Bit", "QUANTILE_8BIT"), ("hm:Blockwise8Bit", "BLOCKWISE_8BIT")]:
        ct = getattr(CompressionType, ctype)
        try:
            probe = torch.randn(4096)
            deserialize_torch_tensor(serialize_torch_tensor(probe, ct))
        except Exception as exc:  # noqa: BLE001 - e.g. bitsandbytes missing
            notes.append(f"{name} unavailable: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}")
            continue
        out[name] = (
            lambda t, ct=ct: serialize_torch_tensor(t, ct),
            lambda msg: deserialize_torch_tensor(msg),
            lambda msg: len(msg.buffer),
        )
    return out, notes


def best_of(fn: Callable, repeats: int = 3) -> tuple[float, object]:
    best, result = math.inf, None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def measure(name: str, enc_fn, dec_fn, nbytes_fn, x: torch.Tensor, size: str, dist: str) -> Row:
    t_enc, msg = best_of(lambda: enc_fn(x))
    t_dec, y = best_of(lambda: dec_fn(msg))
    y = y.float().reshape(x.shape)
    gb = x.numel() * 4 / 1e9
    err = float((y - x).norm() / x.norm())
    return Row(name, size, dist, x.numel() * 4 / nbytes_fn(msg), err, gb / t_enc, gb / t_dec)


@dataclass
class Speed:
    path: str
    size: str
    gbps: float  # 4 * numel / best CPU seconds (thread time) of one encode followed by one decode
    wall_gbps: float  # the same over best wall-clock seconds


INT8_PATHS = ("encode + decode (fresh outputs)", "encode + decode(out=reused)", "encode_borrowed + decode(out=reused)")
MEMCPY = "ceiling: memcpy fp32 into a reused buffer"


def int8_speed(size: str, repeats: int, seed: int = 0) -> list[Speed]:
    """Best-of encode+decode GB/s per core of today's int8 paths, the same paths of the codec before
    issue 45 (benchmarks/harness/int8_legacy.py), and two references, interleaved in one run."""
    from benchmarks.harness.int8_legacy import LegacyInt8, legacy_decode

    numel = parse_size(size)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    reused = torch.empty(numel)
    codec, old = get_codec("int8"), LegacyInt8()
    if b"".join(codec.encode(x).buffers) != b"".join(old.encode(x).buffers):
        raise SystemExit("int8 wire bytes differ from the baseline implementation's")
    paths: dict[str, Callable[[], object]] = {
        MEMCPY: lambda: reused.copy_(x),
        "reference: x.to(float16), fresh output": lambda: x.to(torch.float16),
    }
    for tag, c, dec in (("int8", codec, decode), ("int8 before #45", old, legacy_decode)):
        paths[f"{tag}: {INT8_PATHS[0]}"] = lambda c=c, dec=dec: dec(c.encode(x))
        paths[f"{tag}: {INT8_PATHS[1]}"] = lambda c=c, dec=dec: dec(c.encode(x), out=reused)
        paths[f"{tag}: {INT8_PATHS[2]}"] = lambda c=c, dec=dec: dec(c.encode_borrowed(x), out=reused)
    cpu: dict[str, list[float]] = {name: [] for name in paths}
    wall: dict[str, list[float]] = {name: [] for name in paths}
    for rep in range(repeats + 1):
        for name, fn in paths.items():
            w0, c0 = time.perf_counter(), time.thread_time()
            fn()
            if rep:  # the first round warms the workspace and the reused buffer
                cpu[name].append(time.thread_time() - c0)
                wall[name].append(time.perf_counter() - w0)
    gb = numel * 4 / 1e9
    return [Speed(name, size, gb / min(cpu[name]), gb / min(wall[name])) for name in paths]


def print_speed(report: Report, speeds: list[Speed]) -> None:
    sizes = list(dict.fromkeys(s.size for s in speeds))
    memcpy = {s.size: s.gbps for s in speeds if s.path == MEMCPY}
    report.print("int8 encode+decode per core (one torch thread): GB/s of fp32 input, best of the repeats "
                 "by CPU time of the thread (wall clock in brackets), and as a fraction of memcpy")
    head = f"| {'path':55s} | " + " | ".join(f"{size + ' GB/s':>16s} | {'/memcpy':>7s}" for size in sizes) + " |"
    report.print(head)
    report.print("|" + "|".join("-" * len(c) for c in head.split("|")[1:-1]) + "|")
    for path in dict.fromkeys(s.path for s in speeds):
        cells = [next(s for s in speeds if s.path == path and s.size == size) for size in sizes]
        report.print(f"| {path:55s} | " + " | ".join(
            f"{c.gbps:6.2f} ({c.wall_gbps:5.2f} wall) | {c.gbps / memcpy[c.size]:7.3f}" for c in cells) + " |")


def make_tensor(numel: int, dist: str, gen: torch.Generator) -> torch.Tensor:
    if dist == "normal":
        return torch.randn(numel, generator=gen)
    # Student-t with df=2: normal / sqrt(chi2_2 / 2), chi2_2 = -2 log U
    z = torch.randn(numel, generator=gen)
    u = torch.rand(numel, generator=gen).clamp_min_(1e-12)
    return z / torch.sqrt(-torch.log(u))


def parse_size(text: str) -> int:
    text = text.strip().upper()
    mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1], 1)
    return int(float(text.rstrip("KMG")) * mult)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser, quick="1M only (smoke run)", seed="the random tensors (default 0)")
    parser.add_argument("--sizes", default="1M,16M,64M", help="comma-separated numels, e.g. 1M,16M")
    parser.add_argument("--speed-only", action="store_true", help="only the int8 speed section (16M, 64M)")
    parser.add_argument("--repeats", type=int, default=9, help="timed repetitions per path in the speed section")
    args = parser.parse_args()
    torch.set_num_threads(1)
    seed = seed_or(args, 0)
    report = Report("swarmgrad's codecs against hivemind's, one CPU core", args.out)
    if args.speed_only:
        speeds = [s for size in SPEED_SIZES for s in int8_speed(size, args.repeats, seed)]
        print_speed(report, speeds)
        report.print()
        print_speed_targets(report, speeds)
        report.results = {"speed": [vars(s) for s in speeds]}
        report.finish()
        return
    sizes = ["1M"] if args.quick else args.sizes.split(",")
    hm, notes = hivemind_codecs()
    rows: list[Row] = []
    gen = torch.Generator().manual_seed(seed)
    for size in sizes:
        numel = parse_size(size)
        for dist in ("normal", "student-t2"):
            x = make_tensor(numel, dist, gen)
            for spec in SWARMGRAD_SPECS:
                codec = get_codec(spec)
                # powersgd sees a matrix (rows of 1024); warm start is per codec object
                shape = (numel // 1024, 1024) if spec.startswith("powersgd") else (numel,)
                xs = x.view(shape)
                row = measure(spec, codec.encode, decode, lambda e: e.nbytes, xs, size, dist)
                rows.append(row)
            for name, (enc_fn, dec_fn, nb_fn) in hm.items():
                if name == "hm:Quantile8Bit" and numel > QUANTILE_MAX_NUMEL:
                    note = f"hm:Quantile8Bit skipped above {QUANTILE_MAX_NUMEL // 2**20}M (slow: ~3 s per 16M)"
                    if note not in notes:
                        notes.append(note)
                    continue
                rows.append(measure(name, enc_fn, dec_fn, nb_fn, x, size, dist))
            del x
    print_table(report, rows)
    report.print()
    for note in notes:
        report.print(f"note: {note}")
    report.print()
    speeds = [] if args.quick else [s for size in SPEED_SIZES for s in int8_speed(size, args.repeats, seed)]
    if speeds:
        print_speed(report, speeds)
        report.print()
    print_targets(report, rows)
    print_speed_targets(report, speeds)
    report.results = {"rows": [vars(r) for r in rows], "speed": [vars(s) for s in speeds], "notes": notes}
    report.finish()


def print_table(report: Report, rows: list[Row]) -> None:
    head = f"| {'codec':32s} | {'size':>4s} | {'dist':10s} | {'ratio':>7s} | {'rel L2':>8s} | {'enc GB/s':>8s} | {'dec GB/s':>8s} |"
    report.print(head)
    report.print("|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|")
    for r in rows:
        report.print(f"| {r.codec:32s} | {r.size:>4s} | {r.dist:10s} | {r.ratio:7.1f} | {r.err:8.5f} | "
              f"{r.enc:8.2f} | {r.dec:8.2f} |")


def both(r: Row) -> float:
    """Throughput of encode+decode together (GB/s of fp32 input)."""
    return 1.0 / (1.0 / r.enc + 1.0 / r.dec)


def print_targets(report: Report, rows: list[Row]) -> None:
    report.print("targets (single core):")
    for size in dict.fromkeys(r.size for r in rows):
        for dist in ("normal", "student-t2"):
            sel = {r.codec: r for r in rows if r.size == size and r.dist == dist}
            ours = sel.get("int8")
            hm8 = [sel[n] for n in ("hm:Uniform8Bit", "hm:Quantile8Bit", "hm:Blockwise8Bit") if n in sel]
            if ours and hm8:
                fastest = max(hm8, key=both)
                ok = both(ours) >= both(fastest) and ours.err <= fastest.err
                report.print(f"  {'PASS' if ok else 'FAIL'} int8 vs fastest hivemind 8-bit ({fastest.codec}) "
                      f"[{size} {dist}]: {both(ours):.2f} vs {both(fastest):.2f} GB/s enc+dec, "
                      f"err {ours.err:.4f} vs {fastest.err:.4f}")
            topk = sel.get("topk:fraction=0.01,values=fp16")
            if topk:
                ok = topk.ratio >= 40
                report.print(f"  {'PASS' if ok else 'FAIL'} topk 1% (fp16 values) >= 40x smaller than fp32 "
                      f"[{size} {dist}]: {topk.ratio:.1f}x")


def print_speed_targets(report: Report, speeds: list[Speed]) -> None:
    """Issue 45's goal: int8 encode+decode >= 2 GB/s per core at 16M and 64M, on each path."""
    for size in dict.fromkeys(s.size for s in speeds):
        by_path = {s.path: s.gbps for s in speeds if s.size == size}
        for path in INT8_PATHS:
            new, old = by_path[f"int8: {path}"], by_path[f"int8 before #45: {path}"]
            report.print(f"  {'PASS' if new >= 2.0 else 'FAIL'} int8 enc+dec >= 2 GB/s per core [{size}, {path}]: "
                         f"{new:.2f} GB/s ({new / old:.2f}x the codec before #45: {old:.2f})")


if __name__ == "__main__":
    main()
