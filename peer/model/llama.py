"""A Llama-family decoder (RMSNorm, rotary positions, SwiGLU, grouped-query attention), cut into
pipeline stages.

The layers are Hugging Face's ``LlamaForCausalLM`` layer for layer (rotary embeddings in the
``rotate_half`` convention, no biases, RMSNorm computed in fp32), so a run's weights map 1:1
to a transformers checkpoint: a stage's parameter ``name`` is the Hugging Face tensor
``hf_name(name)``, which is ``"model." + name`` except for the head, ``lm_head.weight``. Layers
sit in a ``ModuleDict`` keyed by their *global* index, so stage 1 of a split holds
``layers.6.self_attn.q_proj.weight`` exactly as the unsplit model does.

- stage 0 holds ``embed_tokens`` and its first layers; the last stage holds its layers, ``norm``
  and ``lm_head``; one stage holds everything.
- ``tie_embeddings`` makes the head reuse the embedding matrix. That needs both on one stage
  (``stages.count = 1``): tied across stages, the one tensor would live on two peers that drift
  apart between averaging rounds. The manifest refuses it otherwise.

Initialisation is deterministic and local, as for the GPT (peer/model/gpt.py): each piece
(``"embed"``, ``"head"``, a global layer index) draws from its own generator seeded by
``(seed, "llama", piece)``; modules are built on the meta device, so the global RNG is never
touched, and layer ``i`` has the same weights however the layers are split. With ``init_from``
the stage's tensors are then read from a Hugging Face checkpoint folder instead (only this
stage's, see peer/model/hf.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .gpt import seeded_generator

if TYPE_CHECKING:
    from .entry import StagedModel

__all__ = [
    "LlamaConfig",
    "LlamaStage",
    "build_llama_stage",
    "default_ffn_hidden",
    "hf_name",
    "llama_config",
    "llama_staged_model",
    "swarm_name",
]


def default_ffn_hidden(d_model: int, multiple_of: int = 256) -> int:
    """Llama's SwiGLU width: 2/3 of 4·d (same FLOPs as a 4·d GELU MLP), rounded up to a
    multiple of 256 (768 → 2048, 1024 → 2816, 2048 → 5632)."""
    hidden = int(2 * 4 * d_model / 3)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


@dataclass(frozen=True)
class LlamaConfig:
    """Shape of a Llama-family decoder; fields and defaults follow the manifest's ``[model]``."""

    vocab_size: int = 256
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 0
    """Key/value heads (grouped-query attention); 0 means n_heads (plain multi-head)."""
    seq_len: int = 128
    ffn_hidden: int = 0
    """SwiGLU width; 0 means ``default_ffn_hidden(d_model)``."""
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    boundary_subspace: int = 0
    """k > 0: residual writes before the last stage boundary constrained to a seeded k-dimensional
    subspace, so k values per token cross a boundary (peer/model/subspace.py); 0: off."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"LlamaConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.n_kv_heads < 0 or self.ffn_hidden < 0:
            raise ValueError("LlamaConfig.n_kv_heads and ffn_hidden must be >= 0 (0: the default)")
        if self.d_model % self.n_heads:
            raise ValueError(f"LlamaConfig.d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        if self.n_heads % self.kv_heads:
            raise ValueError(f"LlamaConfig.n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"LlamaConfig: head dimension d_model / n_heads = {self.head_dim} must be even (rotary)")
        if not (self.rope_theta > 0 and self.norm_eps > 0):
            raise ValueError("LlamaConfig.rope_theta and norm_eps must be > 0")
        if not 0 <= self.boundary_subspace < self.d_model:
            raise ValueError(f"LlamaConfig.boundary_subspace must be in [0, d_model={self.d_model}), "
                             f"got {self.boundary_subspace}")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def ffn(self) -> int:
        return self.ffn_hidden or default_ffn_hidden(self.d_model)


def hf_name(name: str) -> str:
    """A stage parameter's Hugging Face ``LlamaForCausalLM`` name (global layer indices)."""
    return name if name.startswith("lm_head.") else "model." + name


def swarm_name(hf: str) -> str:
    """Inverse of ``hf_name``."""
    return hf[len("model."):] if hf.startswith("model.") else hf


class RMSNorm(nn.Module):
    """x / rms(x) · weight, computed in fp32 and cast back (as transformers' LlamaRMSNorm)."""

    def __init__(self, d: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(d))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rotary_tables(cfg: LlamaConfig, t: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """cos and sin, [T, head_dim], in the layout ``rotate_half`` expects (both halves equal)."""
    hd = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64, device=device).float() / hd))
    freqs = torch.outer(torch.arange(t, device=device).float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, out_dim: int) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.hd = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.d_model, cfg.n_heads * self.hd, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, self.n_kv * self.hd, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, self.n_kv * self.hd, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * self.hd, out_dim, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv, self.hd).transpose(1, 2)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv != self.n_heads)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, self.n_heads * self.hd))


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig, out_dim: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.d_model, cfg.ffn, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, cfg.ffn, bias=False)
        self.down_proj = nn.Linear(cfg.ffn, out_dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """A pre-norm block; ``out_dim`` < d_model: its two residual writes are subspace coefficients
    (``forward`` with ``base`` and ``basis``)."""

    def __init__(self, cfg: LlamaConfig, out_dim: int | None = None) -> None:
        super().__init__()
        out_dim = out_dim or cfg.d_model
        self.input_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.self_attn = Attention(cfg, out_dim)
        self.post_attention_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = MLP(cfg, out_dim)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, base: Tensor | None = None,
                basis: Tensor | None = None) -> Tensor:
        """x -> x + the block's writes; with ``basis`` (boundary_subspace), x is z and the residual
        is ``base + z·basisᵀ``, rebuilt before each read so that a receiver of z rebuilds exactly
        what was read here: returns the new z. (One ``forward`` either way, so activation
        checkpointing, which wraps it, covers both.)"""
        if basis is None:
            x = x + self.self_attn(self.input_layernorm(x), cos, sin)
            return x + self.mlp(self.post_attention_layernorm(x))
        assert base is not None
        x = x + self.self_attn(self.input_layernorm(base + x @ basis.T), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(base + x @ basis.T))


class LlamaStage(nn.Module):
    """One contiguous slice of the decoder: optional embedding, some layers, optional head.

    ``layers[str(i)]`` is global layer ``i``; parameter names map to Hugging Face's by ``hf_name``.
    """

    def __init__(self, cfg: LlamaConfig, stage_index: int, n_stages: int, first_layer: int, n_layers: int) -> None:
        super().__init__()
        if cfg.tie_embeddings and n_stages > 1:
            raise ValueError("tie_embeddings needs the embedding and the head on one stage (stages.count = 1)")
        if cfg.boundary_subspace and n_stages < 2:
            raise ValueError("boundary_subspace constrains what crosses a stage boundary: it needs stages.count >= 2")
        self.cfg = cfg
        self.stage_index, self.n_stages, self.first_layer = stage_index, n_stages, first_layer
        self.is_first, self.is_last = stage_index == 0, stage_index == n_stages - 1
        self.k = cfg.boundary_subspace
        # the last stage's layers write freely: nothing crosses after them
        self.constrained = bool(self.k) and not self.is_last
        if self.is_first:
            if self.k:
                self.embed_subspace = nn.Embedding(cfg.vocab_size, self.k)
            else:
                self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        if self.k:
            # seeded, never trained, sent, averaged or saved (peer/model/subspace.py): buffers
            self.register_buffer("basis", torch.empty(cfg.d_model, self.k), persistent=False)
            self.register_buffer("frozen_embed", torch.empty(cfg.vocab_size, cfg.d_model), persistent=False)
        out_dim = self.k if self.constrained else cfg.d_model
        self.layers = nn.ModuleDict({str(first_layer + j): DecoderLayer(cfg, out_dim) for j in range(n_layers)})
        if self.is_last:
            self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
            if not cfg.tie_embeddings:
                self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        """Stage 0: int64 tokens [B, T] -> hidden [B, T, D]; middle: hidden -> hidden; last:
        hidden -> logits [B, T, vocab]. Raises ValueError if T > cfg.seq_len."""
        t = x.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence length {t} exceeds model.seq_len={self.cfg.seq_len}")
        if self.k:
            return self._forward_subspace(x)
        if self.is_first:
            x = self.embed_tokens(x)
        cos, sin = rotary_tables(self.cfg, t, x.device)
        for layer in self.layers.values():
            x = layer(x, cos, sin)
        if self.is_last:
            x = self.norm(x)
            x = F.linear(x, self.embed_tokens.weight) if self.cfg.tie_embeddings else self.lm_head(x)
        return x

    def _forward_subspace(self, x: Tensor) -> Tensor:
        """Stage 0: ids [B, T]; later stages: [B, T, k+1], z then the ids as fp32
        (TokenCarry.stage_input). Stages before the last return z [B, T, k]."""
        if self.is_first:
            ids = x
            z = self.embed_subspace(ids)
        else:
            ids, z = x[..., self.k].long(), x[..., :self.k]
        base = F.embedding(ids, self.frozen_embed)
        cos, sin = rotary_tables(self.cfg, x.shape[1], x.device)
        if self.constrained:
            for layer in self.layers.values():
                z = layer(z, cos, sin, base, self.basis)
            return z
        x = base + z @ self.basis.T
        for layer in self.layers.values():
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Fill every parameter from generators keyed by (seed, "llama", piece); see the module doc."""
        std = 0.02
        # Residual projections scaled by 1/sqrt(2·n_layers) (GPT-2): each layer adds two of them
        # to the residual stream, whose variance would otherwise grow with depth.
        resid_std = std / math.sqrt(2 * self.cfg.n_layers)
        if self.k:
            self.init_buffers(seed)
        if self.is_first:
            embed = self.embed_subspace if self.k else self.embed_tokens
            embed.weight.normal_(0.0, std, generator=seeded_generator(seed, "llama", "embed"))
        for key, layer in self.layers.items():
            gen = seeded_generator(seed, "llama", "layer", int(key))
            layer.input_layernorm.weight.fill_(1.0)
            layer.post_attention_layernorm.weight.fill_(1.0)
            attn, mlp = layer.self_attn, layer.mlp
            for lin, s in ((attn.q_proj, std), (attn.k_proj, std), (attn.v_proj, std), (attn.o_proj, resid_std),
                           (mlp.gate_proj, std), (mlp.up_proj, std), (mlp.down_proj, resid_std)):
                lin.weight.normal_(0.0, s, generator=gen)
        if self.is_last:
            self.norm.weight.fill_(1.0)
            if not self.cfg.tie_embeddings:
                self.lm_head.weight.normal_(0.0, std, generator=seeded_generator(seed, "llama", "head"))


    @torch.no_grad()
    def init_buffers(self, seed: int) -> None:
        """The seeded subspace basis and frozen embedding (boundary_subspace only)."""
        from .subspace import frozen_embedding, subspace_basis
        self.basis.copy_(subspace_basis(seed, self.cfg.d_model, self.k))
        self.frozen_embed.copy_(frozen_embedding(seed, self.cfg.vocab_size, self.cfg.d_model))


def build_llama_stage(cfg: LlamaConfig, layers_per_stage: Sequence[int], stage: int, seed: int,
                      init_from: str | Path | None = None) -> LlamaStage:
    """Build stage ``stage`` of the decoder split as ``layers_per_stage``.

    Without ``init_from``: deterministically initialised (same arguments, bit-identical
    parameters; layer ``i`` independent of the split). With it: the stage's tensors read from
    that Hugging Face checkpoint folder (only this stage's; shapes checked, ValueError naming
    the tensor otherwise).

    Raises:
        ValueError: a split that does not cover ``cfg.n_layers`` with >= 1 layer per stage, a
            stage out of range, tied embeddings across stages, or a checkpoint that does not fit.
    """
    layers = [int(n) for n in layers_per_stage]
    if not layers or any(n < 1 for n in layers) or sum(layers) != cfg.n_layers:
        raise ValueError(f"layers_per_stage={layers} must give every stage >= 1 layer and sum to "
                         f"n_layers={cfg.n_layers}")
    if init_from is not None and cfg.boundary_subspace:
        raise ValueError(_SUBSPACE_INIT_FROM)
    if not 0 <= stage < len(layers):
        raise ValueError(f"stage {stage} out of range for {len(layers)} stages")
    with torch.device("meta"):
        module = LlamaStage(cfg, stage, len(layers), first_layer=sum(layers[:stage]), n_layers=layers[stage])
    module.to_empty(device="cpu")
    if init_from is None:
        module.init_weights(seed)
    else:
        from .hf import load_stage_tensors
        tensors = load_stage_tensors(Path(init_from), {n: tuple(p.shape) for n, p in module.named_parameters()})
        with torch.no_grad():
            for name, p in module.named_parameters():
                p.copy_(tensors[name])
    return module


def llama_staged_model(cfg: LlamaConfig, layers_per_stage: Sequence[int], seed: int,
                       init_from: str | Path | None = None) -> "StagedModel":
    """The decoder split as ``layers_per_stage``; with ``init_from`` its config.json is checked
    against ``cfg`` now (HFCheckpointError naming the field), each stage's tensors read when the
    stage is built."""
    from .entry import decoder_staged_model
    layers = tuple(int(n) for n in layers_per_stage)
    if not layers or any(n < 1 for n in layers) or sum(layers) != cfg.n_layers:
        raise ValueError(f"layers_per_stage={list(layers)} must give every stage >= 1 layer and sum to "
                         f"n_layers={cfg.n_layers}")
    if cfg.tie_embeddings and len(layers) > 1:
        raise ValueError("tie_embeddings needs the embedding and the head on one stage (stages.count = 1)")
    if cfg.boundary_subspace and len(layers) < 2:
        raise ValueError("boundary_subspace constrains what crosses a stage boundary: it needs stages.count >= 2")
    if init_from is not None:
        if cfg.boundary_subspace:
            raise ValueError(_SUBSPACE_INIT_FROM)
        from .hf import check_hf_config
        check_hf_config(Path(init_from), cfg)
    return decoder_staged_model(len(layers), cfg.seq_len, cfg.d_model, cfg.vocab_size,
                                lambda stage: build_llama_stage(cfg, layers, stage, seed, init_from),
                                boundary_subspace=cfg.boundary_subspace)


_SUBSPACE_INIT_FROM = ("init_from with boundary_subspace: a checkpoint's full-rank residual writes have no exact "
                       "k-dimensional form; start from the seeded initialisation or set boundary_subspace = 0")


def llama_config(md) -> LlamaConfig:
    """The LlamaConfig of a manifest's ``[model]`` section."""
    return LlamaConfig(vocab_size=md.vocab_size, d_model=md.d_model, n_layers=md.n_layers, n_heads=md.n_heads,
                       n_kv_heads=md.n_kv_heads, seq_len=md.seq_len, ffn_hidden=md.ffn_hidden,
                       rope_theta=md.rope_theta, norm_eps=md.norm_eps, tie_embeddings=md.tie_embeddings,
                       boundary_subspace=md.boundary_subspace)
