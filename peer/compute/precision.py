"""How a stage computes: the dtype of its matmuls, whether its blocks recompute their activations,
and which AdamW kernel steps it. Pure tensor code, no network.

Mixed precision follows the usual recipe (torchtitan, Megatron): the parameters, their gradients,
AdamW's moments, θ_global and the outer momentum stay fp32 (the master weights); only the forward's
matmuls and attention run in bfloat16 under `torch.autocast`, and their backward follows. So a round's
pseudo-gradient, its codec and the state a joiner downloads are the same whatever a replica computes
in, and replicas of one stage on different hardware average as equals.

The compute dtype is resolved per peer, not per run (`resolve_compute_dtype`): the manifest's
`[model] dtype` applies on CUDA; on the CPU a peer computes in float32 unless its operator asks for
bfloat16 (`swarmgrad peer --compute-dtype bfloat16`): CPU autocast is slower than fp32 on most CPUs
without AMX, and a CPU peer's float32 is exact, so it is never a surprise.

Tensors that cross a stage boundary are rounded to the compute dtype before their codec
(`boundary`): a bf16 peer's activations carry bf16 information only, so the fp32 codec would
spend twice the bytes of the lossless bf16 one on rounding noise, and downstream replicas that
compute in float32 see exactly what a bf16 upstream replica meant.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import ContextManager, Iterator

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""The names `[model] dtype` and `--compute-dtype` accept."""


@dataclass(frozen=True)
class Precision:
    """One replica's compute dtype on its device. Invariant: parameters and optimiser state stay
    fp32; `autocast()` is the only place the compute dtype takes effect, besides `boundary`."""

    device: torch.device
    compute_dtype: torch.dtype = torch.float32

    @property
    def mixed(self) -> bool:
        return self.compute_dtype != torch.float32

    def autocast(self) -> ContextManager[None]:
        """The forward's context: autocast to the compute dtype, or nothing in float32."""
        if not self.mixed:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.compute_dtype)

    def boundary(self, tensor: torch.Tensor) -> torch.Tensor:
        """A tensor about to cross a stage boundary, on the CPU in float32 for its codec, holding
        values of the compute dtype (rounded to nearest-even; lossless in float32)."""
        t = tensor.detach()
        if self.mixed and t.is_floating_point():
            t = t.to(self.compute_dtype)
        return t.to("cpu", torch.float32)

    @property
    def name(self) -> str:
        return precision_name(self.compute_dtype)


def precision_name(dtype: torch.dtype) -> str:
    """The `COMPUTE_DTYPES` name of `dtype`."""
    return next(k for k, v in COMPUTE_DTYPES.items() if v == dtype)


def resolve_compute_dtype(manifest_dtype: str, device: str | torch.device, asked: str = "auto") -> torch.dtype:
    """The dtype a peer computes in: `asked` (`--compute-dtype`) when it names one, else the
    manifest's on CUDA and float32 elsewhere (module docstring).

    Raises:
        ValueError: an unknown dtype name, or bfloat16 on a CUDA device that cannot compute in it.
    """
    dev = torch.device(device)
    if asked not in ("auto", *COMPUTE_DTYPES):
        raise ValueError(f"--compute-dtype {asked!r}: expected auto, {' or '.join(COMPUTE_DTYPES)}")
    if manifest_dtype not in COMPUTE_DTYPES:
        raise ValueError(f"model.dtype {manifest_dtype!r}: expected {' or '.join(COMPUTE_DTYPES)}")
    if asked != "auto":
        name = asked
    else:
        name = manifest_dtype if dev.type == "cuda" else "float32"
    dtype = COMPUTE_DTYPES[name]
    if dtype == torch.bfloat16 and dev.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ValueError(f"{dev}: this GPU cannot compute in bfloat16 (compute capability < 8.0); "
                         "use --compute-dtype float32")
    return dtype


def fused_adamw_supported(device: torch.device) -> bool:
    """Whether AdamW's fused kernel runs on `device`: one kernel for all of a stage's tensors
    instead of several per tensor, which matters on a GPU (CUDA). On the CPU the default
    (foreach) path is kept: it is what the CPU figures in docs/measurements.md were taken with."""
    return device.type == "cuda"


def checkpointed_blocks(module: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a stage module that activation checkpointing wraps: the children of
    its first ModuleList (or ModuleDict: the Llama stage keys its layers by global index) named
    `blocks` or `layers` (the built-in GPT and Llama stages; an entry-point model that names its
    blocks so gets it too)."""
    for name, child in module.named_modules():
        if name.rsplit(".", 1)[-1] in ("blocks", "layers"):
            if isinstance(child, nn.ModuleList):
                return list(child)
            if isinstance(child, nn.ModuleDict):
                return list(child.values())
    return []


def enable_activation_checkpointing(module: nn.Module) -> int:
    """Make every block of `module` keep only its input for backward and recompute the rest then
    (torch.utils.checkpoint, non-reentrant, so it composes with autograd.grad and autocast).
    Parameter names and the state dict are unchanged: each block's class is swapped for a subclass
    whose forward checkpoints its own (not a wrapped bound method, which a deepcopy — the
    evaluation copy — would keep pointing at the original block's weights).
    Returns how many blocks are checkpointed (0: the module has no block list, nothing changes)."""
    blocks = checkpointed_blocks(module)
    for block in blocks:
        cls = type(block)
        if not getattr(cls, "_swarmgrad_checkpointed", False):
            block.__class__ = _checkpointed_class(cls)
    return len(blocks)


@functools.cache
def _checkpointed_class(cls: type[nn.Module]) -> type[nn.Module]:
    def forward(self: nn.Module, *args: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():  # an evaluation keeps nothing for a backward anyway
            return cls.forward(self, *args, **kwargs)
        return checkpoint(cls.forward, self, *args, use_reentrant=False, **kwargs)

    return type(f"Checkpointed{cls.__name__}", (cls,), {"forward": forward, "_swarmgrad_checkpointed": True})


def parameters_fp32(module: nn.Module) -> Iterator[str]:
    """Names of floating-point parameters that are not fp32 (the invariant's check; empty when it holds)."""
    return (n for n, p in module.named_parameters() if p.is_floating_point() and p.dtype != torch.float32)
