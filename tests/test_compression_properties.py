"""Property-based tests: any shape, finite values of any magnitude, every codec.

Budgets (per value, x̂ = decode(encode(x))):
- fp32: exact; fp16: 2**-11 |x| + 2**-25 (for |x| <= 65504); bf16: 2**-8 |x| + 1e-38
- int8 / int4: absmax_block / (2 L) with L = 127 / 7 (+1e-36 for subnormal blocks)
- topk (fp32 values): kept values exact, every dropped |x| <= every kept |x|
- powersgd: ||x - x̂|| <= ||x|| (a projection) for low-rank shapes; fallback budget otherwise
"""

from __future__ import annotations

import math

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from swarmgrad.compression import decode, get_codec
from support.wire import rebuilt

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

shapes = hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=9)


def arrays(max_abs: float = 1e30):
    """Finite float32 arrays mixing magnitudes (scaled by a drawn power of ten)."""
    elems = st.floats(-1.0, 1.0, width=32, allow_nan=False, allow_infinity=False)

    @st.composite
    def build(draw):
        shape = draw(shapes)
        base = draw(hnp.arrays(np.float32, shape, elements=elems))
        exp = draw(st.integers(-30, int(math.log10(max_abs))))
        return torch.from_numpy(np.asarray(base.astype(np.float64) * 10.0**exp)).float()

    return build()


def blockwise_bound(x: torch.Tensor, block: int, levels: int) -> torch.Tensor:
    flat = x.reshape(-1)
    n = flat.numel()
    padded = torch.cat([flat.abs(), torch.zeros((-n) % block)])
    absmax = padded.view(-1, block).amax(1).repeat_interleave(block)[:n]
    return (absmax / (2 * levels) * (1 + 1e-5) + 1e-36).reshape(x.shape)


@SETTINGS
@given(x=arrays())
def test_fp32_exact(x: torch.Tensor) -> None:
    y = decode(rebuilt(get_codec("fp32").encode(x)))
    assert y.shape == x.shape and torch.equal(y, x)


@SETTINGS
@given(x=arrays(max_abs=1e4))
def test_fp16_budget(x: torch.Tensor) -> None:
    y = decode(rebuilt(get_codec("fp16").encode(x)))
    assert y.shape == x.shape
    assert bool(((y - x).abs() <= x.abs() * 2**-11 + 2**-25).all())


@SETTINGS
@given(x=arrays())
def test_bf16_budget(x: torch.Tensor) -> None:
    y = decode(rebuilt(get_codec("bf16").encode(x)))
    assert y.shape == x.shape
    assert bool(((y - x).abs() <= x.abs() * 2**-8 + 1e-38).all())


@SETTINGS
@given(x=arrays(), block=st.sampled_from([1, 3, 16, 128]), name=st.sampled_from(["int8", "int4"]))
def test_blockwise_budget(x: torch.Tensor, block: int, name: str) -> None:
    enc = get_codec(name, block_size=block).encode(x)
    y = decode(rebuilt(enc))
    assert y.shape == x.shape
    n = x.numel()
    codes = n if name == "int8" else (n + 1) // 2
    assert enc.nbytes == codes + 4 * math.ceil(n / block)
    assert bool(((y - x).abs() <= blockwise_bound(x, block, 127 if name == "int8" else 7)).all())


@SETTINGS
@given(x=arrays(), fraction=st.sampled_from([0.01, 0.1, 0.5, 1.0]))
def test_topk_keeps_largest(x: torch.Tensor, fraction: float) -> None:
    enc = get_codec("topk", fraction=fraction, values="fp32").encode(x)
    y = decode(rebuilt(enc))
    assert y.shape == x.shape
    n = x.numel()
    k = enc.params["k"]
    assert k == (0 if n == 0 else min(n, max(1, math.ceil(fraction * n - 1e-9))))
    if n == 0:
        return
    kept = torch.zeros(n, dtype=torch.bool)
    flat_x, flat_y = x.reshape(-1), y.reshape(-1)
    diff = flat_y != flat_x
    # exact where kept; zero where dropped; dropped magnitudes never exceed kept ones
    assert bool((flat_y[diff] == 0).all())
    kept = ~diff & (flat_y != 0)
    dropped = diff
    if bool(dropped.any()) and bool(kept.any()):
        assert float(flat_x[dropped].abs().max()) <= float(flat_x[kept].abs().min())
    assert int(dropped.sum()) <= n - k


@SETTINGS
@given(x=arrays(max_abs=1e4), rank=st.integers(1, 3))
def test_powersgd_projection_bound(x: torch.Tensor, rank: int) -> None:
    codec = get_codec("powersgd", rank=rank)
    enc = codec.encode(x)
    y = decode(rebuilt(enc))
    assert y.shape == x.shape
    if enc.codec == "powersgd":
        assert float((y - x).norm()) <= float(x.norm()) * (1 + 1e-4) + 1e-30
    else:
        assert enc.codec == "fp16"
        assert bool(((y - x).abs() <= x.abs() * 2**-11 + 2**-25).all())


@SETTINGS
@given(x=arrays(max_abs=1e4), name=st.sampled_from(["fp32", "fp16", "bf16", "int8", "int4", "topk", "powersgd"]))
def test_json_rebuild_decodes_identically(x: torch.Tensor, name: str) -> None:
    enc = get_codec(name).encode(x)
    assert torch.equal(decode(rebuilt(enc)), decode(enc))
