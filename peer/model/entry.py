"""What a run's model is, as the rest of swarmgrad sees it: a ``StagedModel``.

A ``StagedModel`` says how many stages there are, how to build each one (deterministically,
without the others), the loss on the last stage's output, and the shapes and dtypes of the
tensors that cross each stage boundary, which the pipeline checks every incoming message
against.

Built-in: the byte-level GPT (``gpt_staged_model``, or ``gpt_from_params`` from manifest
parameters). User models come through an entry point ``"package.module:function"`` whose
function takes ``(params, n_stages, seed)`` keyword arguments and returns a ``StagedModel``;
see ``swarmgrad.peer.model.examples`` for a small one.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, fields
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import Tensor, nn

from .gpt import GPTConfig, _check_layers_per_stage, build_gpt_stage, gpt_loss, split_layers
from .subspace import TokenCarry, loss_targets

__all__ = ["StagedModel", "TokenCarry", "gpt_staged_model", "gpt_from_params", "load_entry_point"]

TensorSpec = tuple[tuple[int, ...], torch.dtype]


@dataclass(frozen=True)
class StagedModel:
    """A model cut into ``n_stages`` pipeline stages."""

    n_stages: int
    """Number of pipeline stages (>= 1)."""
    build_stage: Callable[[int], nn.Module]
    """Stage index -> a fresh module with deterministic initial parameters."""
    loss_fn: Callable[[Tensor, Tensor], Tensor]
    """(last stage output, targets) -> scalar mean loss in nats."""
    input_spec: Callable[[int, int], TensorSpec]
    """(stage, batch) -> (shape, dtype) of that stage's input."""
    output_spec: Callable[[int, int], TensorSpec]
    """(stage, batch) -> (shape, dtype) of that stage's output."""
    targets_spec: Callable[[int], TensorSpec]
    """batch -> (shape, dtype) of the targets that travel with a microbatch."""
    token_carry: TokenCarry | None = None
    """Set when stages past the first need the token ids (``boundary_subspace``): the driver sends
    ``wire_targets``, a stage server feeds its module ``stage_input`` and sends back ``input_grad``
    (peer/model/subspace.py). ``input_spec`` of a stage >= 1 is then what crosses, not the module's input."""

    def __post_init__(self) -> None:
        if self.n_stages < 1:
            raise ValueError(f"StagedModel.n_stages must be >= 1, got {self.n_stages}")


def gpt_staged_model(cfg: GPTConfig, layers_per_stage: Sequence[int], seed: int) -> StagedModel:
    """The byte-level GPT split as ``layers_per_stage`` (validated here, not at first build)."""
    layers = tuple(_check_layers_per_stage(cfg, layers_per_stage))  # fail now, not at first build
    return decoder_staged_model(len(layers), cfg.seq_len, cfg.d_model, cfg.vocab_size,
                                lambda stage: build_gpt_stage(cfg, layers, stage, seed))


def decoder_staged_model(n: int, seq_len: int, d_model: int, vocab_size: int,
                         build_stage: Callable[[int], nn.Module], boundary_subspace: int = 0) -> StagedModel:
    """A decoder LM of `n` stages (the built-in GPT's and Llama's shape): token ids into stage 0,
    the fp32 residual stream of `d_model` between stages, logits out of the last, next-token
    cross entropy (gpt_loss) on the targets.

    ``boundary_subspace`` = k > 0 (Llama): k fp32 values per token cross each boundary, and the
    targets that travel are [B, T+1], each sequence's first id in front (peer/model/subspace.py)."""
    carry = TokenCarry(boundary_subspace, seq_len) if boundary_subspace else None
    width = boundary_subspace or d_model

    def hidden(batch: int) -> TensorSpec:
        return (batch, seq_len, width), torch.float32

    def input_spec(stage: int, batch: int) -> TensorSpec:
        _check_stage(stage, n)
        return ((batch, seq_len), torch.int64) if stage == 0 else hidden(batch)

    def output_spec(stage: int, batch: int) -> TensorSpec:
        _check_stage(stage, n)
        return ((batch, seq_len, vocab_size), torch.float32) if stage == n - 1 else hidden(batch)

    return StagedModel(
        n_stages=n,
        build_stage=build_stage,
        loss_fn=gpt_loss if carry is None else _carried_loss,
        input_spec=input_spec,
        output_spec=output_spec,
        targets_spec=lambda batch: ((batch, seq_len + (carry is not None)), torch.int64),
        token_carry=carry,
    )


def _carried_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """gpt_loss on the targets a TokenCarry sent ([B, T+1]) or on plain ones ([B, T])."""
    return gpt_loss(logits, loss_targets(targets, logits.shape[1]))


def gpt_from_params(params: Mapping[str, Any], n_stages: int, seed: int) -> StagedModel:
    """Entry-point form of the built-in GPT: ``params`` holds GPTConfig fields and optionally
    ``layers_per_stage`` (default: ``split_layers(n_layers, n_stages)``).

    Raises:
        ValueError: on an unknown key, or a ``layers_per_stage`` whose length is not ``n_stages``.
    """
    params = dict(params)
    layers = params.pop("layers_per_stage", None)
    known = {f.name for f in fields(GPTConfig)}
    unknown = sorted(set(params) - known)
    if unknown:
        raise ValueError(f"unknown GPT model parameter(s) {unknown}; known: {sorted(known)} and layers_per_stage")
    cfg = GPTConfig(**params)
    if layers is None:
        layers = split_layers(cfg.n_layers, n_stages)
    elif len(layers) != n_stages:
        raise ValueError(f"layers_per_stage={list(layers)} has {len(layers)} entries but the run has {n_stages} stages")
    return gpt_staged_model(cfg, layers, seed)


def load_entry_point(spec: str, params: Mapping[str, Any], n_stages: int, seed: int) -> StagedModel:
    """Import ``"package.module:function"`` and call ``function(params=, n_stages=, seed=)``.

    Raises:
        ValueError: naming ``model.entry_point`` if the spec is malformed, the module cannot be
            imported, the function is missing or not callable, or it returns something other
            than a ``StagedModel`` with ``n_stages`` stages. Errors raised by the function
            itself propagate unchanged.
    """
    module_name, sep, attr = spec.partition(":") if isinstance(spec, str) else ("", "", "")
    if not sep or not module_name or not attr or ":" in attr or not all(
        part.isidentifier() for part in module_name.split(".") + attr.split(".")
    ):
        raise ValueError(f"model.entry_point {spec!r} is malformed: expected 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"model.entry_point {spec!r}: cannot import module {module_name!r}: {exc}") from exc
    fn: Any = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            raise ValueError(f"model.entry_point {spec!r}: module {module_name!r} has no attribute {attr!r}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise ValueError(f"model.entry_point {spec!r}: {attr!r} is not callable")
    model = fn(params=dict(params), n_stages=n_stages, seed=seed)
    if not isinstance(model, StagedModel):
        raise ValueError(
            f"model.entry_point {spec!r} returned {type(model).__name__}, expected a "
            "swarmgrad.peer.model.StagedModel"
        )
    if model.n_stages != n_stages:
        raise ValueError(f"model.entry_point {spec!r} returned {model.n_stages} stages; the run has {n_stages}")
    return model


def _check_stage(stage: int, n_stages: int) -> None:
    if not 0 <= stage < n_stages:
        raise ValueError(f"stage {stage} out of range for {n_stages} stages")
