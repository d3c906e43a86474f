"""ErrorFeedback (sum property, state) and SizeAdaptive."""

from __future__ import annotations

import pytest
import torch

from swarmgrad.compression import CodecError, ErrorFeedback, SizeAdaptive, decode, get_codec


@pytest.mark.parametrize(
    "spec", ["topk:fraction=0.01,values=fp32", "topk:fraction=0.05,values=int8", "int4", "powersgd:rank=2"]
)
def test_error_feedback_sum_tracks_inputs(spec: str) -> None:
    gen = torch.Generator().manual_seed(0)
    ef = ErrorFeedback(get_codec(spec))
    sum_in = torch.zeros(64, 48)
    sum_out = torch.zeros(64, 48)
    gaps = []
    for _ in range(200):
        x = torch.randn(64, 48, generator=gen)
        sum_in += x
        sum_out += decode(ef.encode("w", x))
        gaps.append(float((sum_out - sum_in).norm()))
    residual = ef.residual("w")
    assert residual is not None
    # the telescoping identity: sum(decoded) = sum(inputs) - final residual (fp32 rounding aside)
    assert float((sum_in - sum_out - residual).norm()) <= 1e-3 * float(sum_in.norm()) + 1e-3
    # and the gap does not grow with steps: the last 50 are no worse than 3x the early ones
    early = max(gaps[20:70])
    assert max(gaps[150:]) <= 3 * early
    # without feedback the gap of top-k grows like sqrt(steps) * |dropped|; with it, it stays bounded
    assert gaps[-1] < 0.5 * float(sum_in.norm()) or spec == "powersgd:rank=2"


def test_error_feedback_reduces_bias_vs_plain() -> None:
    gen = torch.Generator().manual_seed(1)
    codec = get_codec("topk", fraction=0.1, values="fp32")
    ef = ErrorFeedback(codec)
    constant = torch.randn(4096, generator=gen)  # the same "gradient" each step
    plain_sum = sum(decode(codec.encode(constant)) for _ in range(100))
    ef_sum = sum(decode(ef.encode("g", constant)) for _ in range(100))
    target = constant * 100
    assert float((ef_sum - target).norm()) < 0.2 * float((plain_sum - target).norm())


@pytest.mark.parametrize("spec", ["int4", "int8", "topk:fraction=0.05,values=int8"])
def test_encode_decoded_is_the_receivers_decode(spec: str) -> None:
    """encode_decoded's tensor is bit for bit what decoding its bytes gives (what the averager
    uses as its own contribution), and it moves the residual exactly as encode does."""
    gen = torch.Generator().manual_seed(3)
    a, b = ErrorFeedback(get_codec(spec)), ErrorFeedback(get_codec(spec))
    for _ in range(3):
        x = torch.randn(20, 33, generator=gen)
        enc, decoded = a.encode_decoded("w", x)
        assert decoded.dtype == torch.float32 and decoded.shape == x.shape
        assert torch.equal(decoded, decode(enc))
        assert enc.buffers == b.encode("w", x).buffers
        assert torch.equal(a.residual("w"), b.residual("w"))


def test_error_feedback_state_dict_round_trip() -> None:
    gen = torch.Generator().manual_seed(2)
    a = ErrorFeedback(get_codec("int4"))
    xs = [torch.randn(300, generator=gen) for _ in range(3)]
    for x in xs:
        a.encode("p", x)
        a.encode("q", x[:100])
    state = a.state_dict()
    assert set(state) == {"p", "q"} and state["q"].shape == (100,)
    b = ErrorFeedback(get_codec("int4"))
    b.load_state_dict(state)
    nxt = torch.randn(300, generator=gen)
    assert a.encode("p", nxt).buffers == b.encode("p", nxt).buffers
    state["p"].add_(1.0)  # state_dict returns copies
    assert not torch.equal(a.state_dict()["p"], state["p"])
    with pytest.raises(CodecError):
        b.load_state_dict({"p": torch.tensor([float("nan")])})
    with pytest.raises(CodecError):
        b.load_state_dict({"p": torch.arange(3)})


def test_error_feedback_reset_shape_and_nonfinite() -> None:
    ef = ErrorFeedback(get_codec("int8"))
    ef.encode("a", torch.randn(10))
    ef.encode("b", torch.randn(10))
    with pytest.raises(CodecError, match="reset"):
        ef.encode("a", torch.randn(11))
    before = ef.residual("a")
    with pytest.raises(CodecError):
        ef.encode("a", torch.full((10,), float("nan")))
    assert torch.equal(ef.residual("a"), before)  # unchanged after a refused encode
    ef.reset("a")
    assert ef.residual("a") is None and ef.residual("b") is not None
    ef.encode("a", torch.randn(11))
    ef.reset()
    assert ef.state_dict() == {}


def test_error_feedback_keeps_original_dtype_and_powersgd_slots() -> None:
    codec = get_codec("powersgd", rank=2)
    ef = ErrorFeedback(codec)
    enc = ef.encode("layer.weight", torch.randn(64, 32).bfloat16())
    assert enc.dtype == "bfloat16"
    assert "layer.weight" in codec.state_dict()  # the name is the warm-start slot


def test_size_adaptive_picks_by_numel() -> None:
    codec = SizeAdaptive(1000, get_codec("fp32"), get_codec("int8"))
    assert codec.encode(torch.randn(999)).codec == "fp32"
    assert codec.encode(torch.randn(1000)).codec == "int8"
    assert codec.encode(torch.randn(10, 100)).codec == "int8"
    small = torch.randn(3, 3)
    assert torch.equal(codec.decode(codec.encode(small)), small)
    assert codec.encode(torch.tensor(1.0)).codec == "fp32"
    assert get_codec(codec.spec()) == codec
    with pytest.raises(CodecError, match="threshold"):
        SizeAdaptive(-1, get_codec("fp32"), get_codec("int8"))
    with pytest.raises(CodecError, match="large"):
        SizeAdaptive(10, get_codec("fp32"), "int8")  # type: ignore[arg-type]


def test_size_adaptive_under_error_feedback() -> None:
    ef = ErrorFeedback(SizeAdaptive(100, get_codec("fp32"), get_codec("topk", fraction=0.1)))
    assert ef.encode("bias", torch.randn(10)).codec == "fp32"
    assert float(ef.residual("bias").abs().max()) == 0.0
    assert ef.encode("w", torch.randn(50, 50)).codec == "topk"


def test_decayed_feedback_is_sparselocos_accumulator() -> None:
    """decay β: each encode sees x + β·e, and the new residual is what that encode dropped; β = 1 is
    plain error feedback; β outside (0, 1] is refused."""
    codec = get_codec("chunktopk", chunk=64, k=16, bits=1)
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(256, generator=g) for _ in range(4)]
    for beta in (1.0, 0.95, 0.5):
        ef = ErrorFeedback(codec, decay=beta)
        e = torch.zeros(256)
        for x in xs:
            sent = decode(ef.encode("w", x))
            assert torch.equal(sent, decode(codec.encode(x + beta * e)))
            e = x + beta * e - sent
            assert torch.allclose(ef.residual("w"), e, atol=1e-6)
    for bad in (0.0, -0.1, 1.5, True):
        with pytest.raises(CodecError):
            ErrorFeedback(codec, decay=bad)
