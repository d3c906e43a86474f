"""A tiny user model, reachable as ``model.entry_point = "swarmgrad.peer.model.examples:tiny_mlp"``.

It shows what an entry point must do: take ``(params, n_stages, seed)``, return a
``StagedModel`` whose stages can each be built alone with deterministic parameters. It runs on
the same byte data as the GPT: each position predicts the next byte from its own byte only
(a bigram model with residual MLP layers), which is enough to learn something and fast.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .entry import StagedModel
from .gpt import seeded_generator, split_layers

__all__ = ["tiny_mlp"]

_DEFAULTS = {"vocab_size": 256, "d_model": 64, "n_layers": 2, "seq_len": 128}


class _ResidualMLP(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, 2 * d)
        self.proj = nn.Linear(2 * d, d)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.proj(F.gelu(self.fc(x)))


class TinyMLPStage(nn.Module):
    """Stage 0: embedding + layers; middle: layers; last: layers + LM head."""

    def __init__(self, p: Mapping[str, int], stage: int, n_stages: int, first_layer: int, n_blocks: int) -> None:
        super().__init__()
        self.stage_index, self.n_stages = stage, n_stages
        self.emb = nn.Embedding(p["vocab_size"], p["d_model"]) if stage == 0 else None
        self.layers = nn.ModuleList(_ResidualMLP(p["d_model"]) for _ in range(n_blocks))
        self.head = nn.Linear(p["d_model"], p["vocab_size"]) if stage == n_stages - 1 else None
        self.first_layer = first_layer

    def forward(self, x: Tensor) -> Tensor:
        if self.emb is not None:
            x = self.emb(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x) if self.head is not None else x

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        if self.emb is not None:
            self.emb.weight.normal_(0.0, 0.1, generator=seeded_generator(seed, "tiny_mlp", "embed"))
        for j, layer in enumerate(self.layers):
            gen = seeded_generator(seed, "tiny_mlp", "layer", self.first_layer + j)
            for lin in (layer.fc, layer.proj):
                lin.weight.normal_(0.0, 0.02, generator=gen)
                lin.bias.zero_()
        if self.head is not None:
            self.head.weight.normal_(0.0, 0.02, generator=seeded_generator(seed, "tiny_mlp", "head"))
            self.head.bias.zero_()


def tiny_mlp(params: Mapping[str, Any], n_stages: int, seed: int) -> StagedModel:
    """Staged residual MLP on byte tokens. ``params`` may set vocab_size, d_model, n_layers
    (default 2, raised to n_stages if smaller) and seq_len."""
    unknown = sorted(set(params) - set(_DEFAULTS))
    if unknown:
        raise ValueError(f"tiny_mlp: unknown parameter(s) {unknown}; known: {sorted(_DEFAULTS)}")
    p = {**_DEFAULTS, **{k: int(v) for k, v in params.items()}}
    p["n_layers"] = max(p["n_layers"], n_stages)
    layers = split_layers(p["n_layers"], n_stages)

    def build_stage(stage: int) -> nn.Module:
        with torch.device("meta"):  # skip default init (it would draw from the global RNG)
            module = TinyMLPStage(p, stage, n_stages, sum(layers[:stage]), layers[stage])
        module.to_empty(device="cpu")
        module.init_weights(seed)
        return module

    def input_spec(stage: int, batch: int) -> tuple[tuple[int, ...], torch.dtype]:
        if stage == 0:
            return (batch, p["seq_len"]), torch.int64
        return (batch, p["seq_len"], p["d_model"]), torch.float32

    def output_spec(stage: int, batch: int) -> tuple[tuple[int, ...], torch.dtype]:
        if stage == n_stages - 1:
            return (batch, p["seq_len"], p["vocab_size"]), torch.float32
        return (batch, p["seq_len"], p["d_model"]), torch.float32

    def loss_fn(logits: Tensor, targets: Tensor) -> Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    return StagedModel(
        n_stages=n_stages,
        build_stage=build_stage,
        loss_fn=loss_fn,
        input_spec=input_spec,
        output_spec=output_spec,
        targets_spec=lambda batch: ((batch, p["seq_len"]), torch.int64),
    )
