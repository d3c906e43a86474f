"""A tiny PNG canvas on the standard library (zlib, struct): the simulator's plot
(`swarmgrad simulate --plot`) and the benchmarks' curves, without a plotting dependency."""
from __future__ import annotations

import struct
import zlib

FONT = {  # 3x5 glyphs, rows top to bottom, 3 bits each
    "0": "111101101101111", "1": "010110010010111", "2": "111001111100111", "3": "111001111001111",
    "4": "101101111001001", "5": "111100111001111", "6": "111100111101111", "7": "111001010010010",
    "8": "111101111101111", "9": "111101111001111", ".": "000000000000010", "-": "000000111000000",
    "/": "001001010100100", "(": "010100100100010", ")": "010001001001010", ":": "000010000010000",
    " ": "000000000000000", "x": "000101010101000", "a": "010101111101101", "b": "110101110101110",
    "c": "111100100100111", "d": "110101101101110", "e": "111100110100111", "f": "111100110100100",
    "g": "111100101101111", "h": "101101111101101", "i": "111010010010111", "j": "001001001101111",
    "k": "101101110101101", "l": "100100100100111", "m": "101111111101101", "n": "110101101101101",
    "o": "111101101101111", "p": "111101111100100", "q": "111101101111001", "r": "110101110101101",
    "s": "111100111001111", "t": "111010010010010", "u": "101101101101111", "v": "101101101101010",
    "w": "101101111111101", "y": "101101010010010", "z": "111001010100111"
}


class Canvas:
    """An RGB image on white: dots, (dashed, thick) lines and 3x5-pixel text; `png()` encodes it."""

    def __init__(self, w: int, h: int):
        self.w, self.h = w, h
        self.px = bytearray(b"\xff" * (w * h * 3))

    def dot(self, x: int, y: int, c: tuple[int, int, int], r: int = 0) -> None:
        for yy in range(y - r, y + r + 1):
            for xx in range(x - r, x + r + 1):
                if 0 <= xx < self.w and 0 <= yy < self.h:
                    self.px[3 * (yy * self.w + xx):3 * (yy * self.w + xx) + 3] = bytes(c)

    def line(self, x0: float, y0: float, x1: float, y1: float, c: tuple[int, int, int], r: int = 0, dash: int = 0) -> None:
        n = int(max(abs(x1 - x0), abs(y1 - y0))) + 1
        for i in range(n + 1):
            if dash and (i // dash) % 2:
                continue
            self.dot(round(x0 + (x1 - x0) * i / n), round(y0 + (y1 - y0) * i / n), c, r)

    def text(self, x: int, y: int, s: str, c: tuple[int, int, int] = (0, 0, 0), k: int = 2) -> None:
        for ch in s.lower():
            g = FONT.get(ch, FONT[" "])
            for i, bit in enumerate(g):
                if bit == "1":
                    for dy in range(k):
                        for dx in range(k):
                            self.dot(x + (i % 3) * k + dx, y + (i // 3) * k + dy, c)
            x += 4 * k

    def png(self) -> bytes:
        raw = b"".join(b"\x00" + bytes(self.px[3 * y * self.w:3 * (y + 1) * self.w]) for y in range(self.h))

        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", self.w, self.h, 8, 2, 0, 0, 0))
                + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))
