"""Subspace-constrained stage boundaries for the Llama family (``[model] boundary_subspace = k``).

The construction of Protocol Models (Ramasinghe et al. 2025, "Protocol Models: Scaling
decentralized training with communication-efficient model parallelism"), exact by construction:

- ``U`` (d_model × k, orthonormal columns) and a frozen token embedding ``E_f`` (vocab × d_model)
  are generated from the run's seed on every stage (``subspace_basis``, ``frozen_embedding``):
  nothing about them is ever sent, averaged or saved.
- The residual stream before the last boundary is ``E_f[ids] + z·Uᵀ`` with ``z`` of k values per
  token: stage 0's trainable embedding is ``embed_subspace`` (vocab × k, its rows are z's start),
  and every residual write of a layer before the last boundary (attention's ``o_proj``, the MLP's
  ``down_proj``) has k outputs that are added to z. The residual each of these layers reads is
  rebuilt as ``E_f[ids] + z·Uᵀ`` (peer/model/llama.py), so a stage computes exactly what the
  receiver of its z will.
- So only z crosses a boundary (``[B, T, k]``, fp32 before the activation codec), and the token
  ids, which travel with the microbatch: the targets are the ids shifted by one, so the targets
  that travel carry one more column in front, each sequence's first id (``TokenCarry``). The
  receiver's residual is ``E_f[ids] + z·Uᵀ``: bit for bit the sender's. The gradient sent back
  is ``dL/dz = dL/dx·U``, exact for the only path through which stage 0's parameters reach the
  loss (``E_f`` is frozen).
- The last stage's layers are not constrained: nothing crosses after them.

Cost per stage (fp32): the frozen table ``vocab × d_model`` and ``U`` (``d_model × k``) as
buffers (not parameters: no gradients, optimiser state or averaging), and for each residual
read of a constrained layer one ``[B·T, k] × [k, d]`` product (4·B·T·k·d FLOPs per layer forward,
against the layer's ~2·B·T·(4·d² + 3·d·ffn)); the constrained ``o_proj`` and ``down_proj`` shrink
from d to k rows.

Export (peer/model/hf.py): multiplied out, the model is an ordinary Llama:
``embed_tokens = E_f + embed_subspace·Uᵀ``, ``o_proj = U·o_projₖ``, ``down_proj = U·down_projₖ``
(``dense_tensors``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch
from torch import Tensor

from .gpt import seeded_generator

__all__ = ["FROZEN_STD", "TokenCarry", "dense_tensors", "frozen_embedding", "subspace_basis"]

FROZEN_STD = 0.02
"""The frozen embedding's standard deviation: the trainable embedding's initial one, so at the
start the model is the unconstrained one's kind of network."""

MAX_VOCAB = 1 << 24
"""Ids ride in an fp32 channel of a stage's input (``TokenCarry.stage_input``): exact below 2²⁴."""


def subspace_basis(seed: int, d_model: int, k: int) -> Tensor:
    """U, [d_model, k], orthonormal columns: QR of a seeded Gaussian, in float64 on the CPU (so
    every peer, whatever its device, gets the same fp32 numbers), rounded to fp32."""
    gen = seeded_generator(seed, "llama", "subspace")
    q, r = torch.linalg.qr(torch.randn(d_model, k, generator=gen, dtype=torch.float64))
    # QR's signs are not unique; fixing diag(R) > 0 makes U a function of the Gaussian alone
    return (q * torch.sign(torch.diagonal(r))).to(torch.float32)


def frozen_embedding(seed: int, vocab_size: int, d_model: int) -> Tensor:
    """E_f, [vocab_size, d_model]: the frozen, full-rank part of every token's embedding."""
    gen = seeded_generator(seed, "llama", "frozen-embed")
    return torch.randn(vocab_size, d_model, generator=gen) * FROZEN_STD


@dataclass(frozen=True)
class TokenCarry:
    """How a stage past the first gets the token ids (for a model whose stages need them).

    Contract: ``wire_targets`` runs on the driver before a microbatch leaves stage 0; the stage
    server of a stage ≥ 1 builds its module's input with ``stage_input`` from the decoded
    activations and the targets that travelled, and sends back ``input_grad`` of that input's
    gradient, which has the shape of the activations that came in.
    """

    k: int
    seq_len: int

    def wire_targets(self, inputs: Tensor, targets: Tensor) -> Tensor:
        """[B, T] ids, [B, T] targets -> [B, T+1]: each sequence's first id, then its targets."""
        return torch.cat([inputs[:, :1].to(targets.dtype), targets], dim=1)

    def stage_input(self, activations: Tensor, targets: Tensor) -> Tensor:
        """z [B, T, k] and the travelling targets [B, T+1] -> [B, T, k+1]: z, then the ids as fp32."""
        ids = targets[:, :-1].to(activations.device, torch.float32)
        return torch.cat([activations, ids.unsqueeze(-1)], dim=-1)

    def input_grad(self, grad: Tensor) -> Tensor:
        """The module input's gradient [B, T, k+1] -> z's [B, T, k] (the ids have none)."""
        return grad[..., :self.k].contiguous()


def loss_targets(targets: Tensor, t: int) -> Tensor:
    """The travelling targets [B, T+1] (or plain ones [B, T]) -> the [B, T] the loss compares with."""
    return targets[:, 1:] if targets.shape[1] == t + 1 else targets


def dense_tensors(tensors: Mapping[str, Tensor], seed: int, vocab_size: int, d_model: int, k: int
                  ) -> dict[str, Tensor]:
    """A subspace model's parameters (every stage's, swarm names) -> the same model's ordinary
    Llama parameters: the frozen embedding added, the constrained projections multiplied out.

    Raises:
        ValueError: no ``embed_subspace.weight`` of shape [vocab_size, k] among them.
    """
    u = subspace_basis(seed, d_model, k)
    out: dict[str, Tensor] = {}
    for name, t in tensors.items():
        t = t.detach().to("cpu", torch.float32)
        if name == "embed_subspace.weight":
            if tuple(t.shape) != (vocab_size, k):
                raise ValueError(f"embed_subspace.weight has shape {tuple(t.shape)}, expected {(vocab_size, k)}")
            out["embed_tokens.weight"] = frozen_embedding(seed, vocab_size, d_model) + t @ u.T
        elif name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")) and t.shape[0] == k:
            out[name] = u @ t  # a constrained layer's: k rows; the last stage's have d_model
        else:
            out[name] = t
    if "embed_tokens.weight" not in out:
        raise ValueError("no embed_subspace.weight among the tensors: not a boundary_subspace model's")
    return out
