"""Evaluation units: what a validation loss in nats per token means in the units people compare.

- nats per token: the mean cross entropy the model's loss returns;
- perplexity: exp(nats per token), per token of this run's tokenizer;
- bits per byte: the same loss per UTF-8 byte of the text the tokens stand for, in bits, which does
  not depend on the tokenizer, so runs with different tokenizers (or the byte-level model) compare.

For the byte-level model a token is a byte, so bits per byte is nats / ln 2 (what ``val_loss`` has
always been).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["EvalUnits", "eval_units"]


@dataclass(frozen=True)
class EvalUnits:
    nats_per_token: float
    perplexity: float
    bits_per_byte: float
    tokens: int
    bytes: int

    def fields(self) -> dict[str, float | int]:
        """The eval event's and records' fields (docs/events.md)."""
        return {"val_nats": self.nats_per_token, "val_ppl": self.perplexity, "val_bpb": self.bits_per_byte,
                "val_tokens": self.tokens, "val_bytes": self.bytes}


def eval_units(nats_per_token: float, tokens: int, n_bytes: int) -> EvalUnits:
    """`nats_per_token` over `tokens` target tokens that stand for `n_bytes` bytes of text.

    NaN in (no batch came back) gives NaN out; a perplexity beyond a float's range is inf.
    """
    if tokens < 0 or n_bytes < 0:
        raise ValueError(f"tokens and bytes must be >= 0, got {tokens}, {n_bytes}")
    if not math.isfinite(nats_per_token):
        return EvalUnits(math.nan, math.nan, math.nan, tokens, n_bytes)
    ppl = math.exp(nats_per_token) if nats_per_token < 700 else math.inf
    bpb = nats_per_token * tokens / n_bytes / math.log(2) if n_bytes else math.nan
    return EvalUnits(nats_per_token, ppl, bpb, tokens, n_bytes)
