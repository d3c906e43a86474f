"""A byte-level GPT decoder, cut into pipeline stages.

The model is nanoGPT's decoder (pre-LayerNorm blocks, causal self-attention, 4x GELU MLP),
written so that any contiguous slice of it can live on its own peer:

- stage 0 holds the token and position embeddings and its first blocks;
- middle stages hold blocks only;
- the last stage holds its blocks, the final LayerNorm and the LM head;
- with a single stage, one module holds everything.

The input embedding and the LM head are NOT tied (GPT-2 ties them): tying would make one
tensor live on two stages, held by different peers that drift between averaging rounds.

Initialisation is deterministic and local: each piece of the model draws its weights from its
own ``torch.Generator`` seeded by ``(seed, piece)``, where a piece is ``"embed"``, ``"head"`` or
a *global* block index. A peer can therefore build its stage without the others, and layer
``i`` gets the same weights whichever way the layers are split across stages. The global RNG
is never touched: modules are created on the meta device and every tensor is filled explicitly.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "GPTConfig",
    "GPTStage",
    "split_layers",
    "build_gpt_stage",
    "build_gpt_stages",
    "gpt_loss",
    "seeded_generator",
]

TensorSpec = tuple[tuple[int, ...], torch.dtype]


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a byte-level GPT. Defaults give a ~0.8M-parameter model."""

    vocab_size: int = 256
    """Number of token ids; 256 for raw bytes."""
    d_model: int = 128
    """Width of the residual stream."""
    n_layers: int = 4
    """Number of transformer blocks in the whole model (all stages together)."""
    n_heads: int = 4
    """Attention heads per block; must divide ``d_model``."""
    seq_len: int = 128
    """Longest sequence the position embedding covers; also the T of boundary specs."""
    dropout: float = 0.0
    """Dropout probability. Keep 0 where exact reproducibility across peers matters."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"GPTConfig.d_model ({self.d_model}) must be divisible by n_heads "
                f"({self.n_heads}); change one of them"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")


def split_layers(n_layers: int, n_stages: int) -> list[int]:
    """Split ``n_layers`` blocks into ``n_stages`` contiguous stages as evenly as possible.

    Earlier stages get the extra block (``split_layers(5, 3) == [2, 2, 1]``): stage 0 also
    does the embedding and the last stage the head, and the head (d_model x vocab) is usually
    the heavier end. Every stage gets at least one block.

    Raises:
        ValueError: if ``n_stages < 1`` or ``n_stages > n_layers``.
    """
    if n_stages < 1:
        raise ValueError(f"n_stages must be >= 1, got {n_stages}")
    if n_layers < 1:
        raise ValueError(f"n_layers must be >= 1, got {n_layers}")
    if n_stages > n_layers:
        raise ValueError(
            f"cannot split {n_layers} layers into {n_stages} stages (each stage needs at "
            f"least one block): use at most {n_layers} stages or more layers"
        )
    base, extra = divmod(n_layers, n_stages)
    return [base + (1 if s < extra else 0) for s in range(n_stages)]


def seeded_generator(seed: int, *key: object) -> torch.Generator:
    """A CPU generator seeded from ``(seed, *key)`` through SHA-256.

    Hashing (rather than ``seed + i``) keeps the streams of neighbouring keys unrelated and is
    stable across machines and Python runs (unlike ``hash()``).
    """
    text = repr((int(seed),) + tuple(key)).encode()
    value = int.from_bytes(hashlib.sha256(text).digest()[:8], "little") & ((1 << 63) - 1)
    gen = torch.Generator(device="cpu")
    gen.manual_seed(value)
    return gen


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)  # residual projection
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        # [B, T, D] -> [B, H, T, D/H]
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).reshape(b, t, d)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model)  # residual projection
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPTStage(nn.Module):
    """One contiguous slice of the GPT: optional embedding, some blocks, optional head.

    Attributes:
        stage_index: position of this stage in the pipeline (0-based).
        n_stages: number of stages in the pipeline.
        first_layer: global index of this stage's first block (``blocks[j]`` is layer
            ``first_layer + j``).
    """

    def __init__(self, cfg: GPTConfig, stage_index: int, n_stages: int, first_layer: int, n_blocks: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.stage_index = stage_index
        self.n_stages = n_stages
        self.first_layer = first_layer
        self.is_first = stage_index == 0
        self.is_last = stage_index == n_stages - 1
        if self.is_first:
            self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
            self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
            self.emb_drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(n_blocks))
        if self.is_last:
            self.ln_f = nn.LayerNorm(cfg.d_model)
            self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        """Stage 0: int64 tokens [B, T] -> hidden [B, T, D]; middle: hidden -> hidden;
        last: hidden -> logits [B, T, vocab]. Raises ValueError if T > cfg.seq_len."""
        if self.is_first:
            t = x.shape[1]
            if t > self.cfg.seq_len:
                raise ValueError(f"sequence length {t} exceeds GPTConfig.seq_len={self.cfg.seq_len}")
            pos = torch.arange(t, device=x.device)
            x = self.emb_drop(self.tok_emb(x) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        if self.is_last:
            x = self.head(self.ln_f(x))
        return x

    def input_spec(self, batch: int) -> TensorSpec:
        """Shape and dtype of this stage's input for a microbatch of ``batch`` sequences."""
        if self.is_first:
            return (batch, self.cfg.seq_len), torch.int64
        return (batch, self.cfg.seq_len, self.cfg.d_model), torch.float32

    def output_spec(self, batch: int) -> TensorSpec:
        """Shape and dtype of this stage's output for a microbatch of ``batch`` sequences."""
        if self.is_last:
            return (batch, self.cfg.seq_len, self.cfg.vocab_size), torch.float32
        return (batch, self.cfg.seq_len, self.cfg.d_model), torch.float32

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Fill every parameter from generators keyed by (seed, piece); see the module doc."""
        std = 0.02
        # GPT-2: residual projections scaled by 1/sqrt(2 * n_layers), since each block adds two
        # of them to the residual stream and its variance would otherwise grow with depth.
        resid_std = std / math.sqrt(2 * self.cfg.n_layers)
        if self.is_first:
            gen = seeded_generator(seed, "embed")
            self.tok_emb.weight.normal_(0.0, std, generator=gen)
            self.pos_emb.weight.normal_(0.0, std, generator=gen)
        for j, block in enumerate(self.blocks):
            gen = seeded_generator(seed, "block", self.first_layer + j)
            for ln in (block.ln1, block.ln2):
                ln.weight.fill_(1.0)
                ln.bias.zero_()
            scaled = ((block.attn.qkv, std), (block.attn.proj, resid_std), (block.mlp.fc, std), (block.mlp.proj, resid_std))
            for lin, s in scaled:
                lin.weight.normal_(0.0, s, generator=gen)
                lin.bias.zero_()
        if self.is_last:
            gen = seeded_generator(seed, "head")
            self.ln_f.weight.fill_(1.0)
            self.ln_f.bias.zero_()
            self.head.weight.normal_(0.0, std, generator=gen)


def _check_layers_per_stage(cfg: GPTConfig, layers_per_stage: Sequence[int]) -> list[int]:
    layers = [int(n) for n in layers_per_stage]
    if not layers:
        raise ValueError("layers_per_stage is empty: give one block count per stage")
    if any(n < 1 for n in layers):
        raise ValueError(f"layers_per_stage={layers}: every stage needs at least one block")
    if sum(layers) != cfg.n_layers:
        raise ValueError(
            f"layers_per_stage={layers} sums to {sum(layers)} but GPTConfig.n_layers="
            f"{cfg.n_layers}; make them agree (e.g. split_layers({cfg.n_layers}, {len(layers)}))"
        )
    return layers


def build_gpt_stage(cfg: GPTConfig, layers_per_stage: Sequence[int], stage: int, seed: int) -> GPTStage:
    """Build stage ``stage`` of the GPT split as ``layers_per_stage``, deterministically initialised.

    Two calls with the same arguments return bit-identical parameters, and the parameters of
    global layer ``i`` do not depend on ``layers_per_stage``. The global RNG is not used.

    Raises:
        ValueError: if ``layers_per_stage`` does not sum to ``cfg.n_layers``, has a stage with
            no block, or ``stage`` is out of range.
    """
    layers = _check_layers_per_stage(cfg, layers_per_stage)
    if not 0 <= stage < len(layers):
        raise ValueError(f"stage {stage} out of range for {len(layers)} stages")
    # Build on the meta device: no memory, and no default init drawing from the global RNG.
    with torch.device("meta"):
        module = GPTStage(cfg, stage, len(layers), first_layer=sum(layers[:stage]), n_blocks=layers[stage])
    module.to_empty(device="cpu")
    module.init_weights(seed)
    return module


def build_gpt_stages(cfg: GPTConfig, layers_per_stage: Sequence[int], seed: int) -> list[GPTStage]:
    """All stages of the split; ``nn.Sequential(*stages)`` is the whole model."""
    return [build_gpt_stage(cfg, layers_per_stage, s, seed) for s in range(len(layers_per_stage))]


def gpt_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean next-byte cross entropy over all positions, in nats. logits [B, T, V], targets [B, T]."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
