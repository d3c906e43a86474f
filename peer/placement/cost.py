"""What a stage costs: compute per sample, memory per replica, state bytes per move. Pure.

Placement (``rules.py``) needs three figures per stage, all derived from the manifest:

- ``cost`` c_s: relative compute of one sample's forward + backward on the stage. A peer that
  runs r samples/s on stage a runs about r·c_a/c_b on stage b. For the built-in GPT it is a
  FLOP count (so is the llama kind's); for an ``entry_point`` model (whose layers we cannot see) it falls back to the
  stage's parameter count (6·P per sample, the dense-transformer rule).
- ``memory`` M_s: bytes a replica needs: the live parameters, the fp32 θ_global copy, the outer
  momentum, the committed snapshot of both (served to joiners, read by evaluations), the copy of
  the weights evaluations run on (on an accelerator, or in another dtype; a CPU fp32 module's
  evaluations read the snapshot in place, so there this overstates the need by one copy), AdamW's
  two moments (four buffers with inner.swarm_second_moment), gradients, the error-feedback
  residual of the round codec (when enabled), the activations kept for backward of
  ``pipeline.max_in_flight`` microbatches, and with ``pipeline.lookahead`` a stash of the
  weights. A peer offering less than M_s cannot serve the stage.
- ``state_bytes``: what a mover or joiner downloads (θ_global + outer momentum, fp32).

Weights, gradients, AdamW's moments and θ_global are fp32 whatever a peer computes in
(peer/compute/precision.py). The activations follow the compute dtype: with ``model.dtype =
"bfloat16"`` (what a CUDA peer computes in; a CPU peer computes in float32 unless asked, so pass
``compute_dtype="float32"`` for it) a block's kept activations are bf16 (half), and every
microbatch in flight also keeps the bf16 copies of the stage's weights its matmuls saved for
backward (autocast casts them once per forward). With ``model.activation_checkpointing`` a block
keeps only its input (the fp32 residual stream, d floats per token) and one block's activations at
a time are rebuilt in the backward, weight copies included.

FLOPs per sample (a sample is one sequence of ``seq_len`` tokens), following Kaplan et al. 2020,
Table 1: forward = 2·(matmul parameters) + 2·n_ctx·d per layer per token (attention scores and
their weighted sum), backward = 2 × forward. Embedding lookups cost no FLOPs; LayerNorm, GELU
and softmax (memory-bound, O(d) per token) are left out, which undercounts tiny models a little.

Activations kept per token and block, with fused attention (no T×T matrix stored; the CPU math
backend stores it, so this undercounts there): the inputs of ln1, qkv, proj, ln2, fc, and the
outputs qkv (3d), fc and gelu (4d each), about 16·d floats. The head keeps ln_f's input and
output, the logits and the loss's softmax (2·d + 2·V floats per token); a non-first stage keeps
its received input (d). These are lower bounds when several drivers route through one replica
(each driver keeps up to ``max_in_flight`` microbatches in flight).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from swarmgrad.peer.manifest import Manifest

if TYPE_CHECKING:  # the GPT path needs no torch; only entry-point models are built
    from swarmgrad.peer.model.entry import StagedModel

FP32 = 4


@dataclass(frozen=True)
class MemoryNeed:
    """Bytes one replica of a stage needs, by purpose."""
    weights: int
    theta_global: int
    momentum: int
    adam: int
    grads: int
    residual: int
    """Error-feedback residuals of the round codec: the member's (averaging.error_feedback) and, with
    averaging.reducer_feedback, the reducer's (up to the whole stage: a replica alone reduces it all)."""
    activations: int
    stash: int = 0
    """With pipeline.lookahead (2+ stages): the copy of the weights the next step's microbatches
    run against (peer/compute/lookahead.py)."""
    snapshot: int = 0
    """θ_global and the outer momentum as last committed (peer/state/stage_state.py): immutable, served to
    joiners; evaluations read its θ_global."""
    eval_copy: int = 0
    """The module evaluations run on, holding the snapshot's θ_global on the module's device
    (``EvalCopy``, peer/compute/evaluation.py): kept from the first evaluation on. Placement does not know a
    peer's device, so it is counted for every peer, though a CPU fp32 module's copy shares the
    snapshot's tensors."""

    @property
    def total(self) -> int:
        return (self.weights + self.theta_global + self.snapshot + self.momentum + self.adam + self.grads
                + self.residual + self.activations + self.stash + self.eval_copy)


@dataclass(frozen=True)
class StageCost:
    stage: int
    params: int
    flops_per_sample: float
    """Forward + backward FLOPs of one sample (GPT), or 6·params (entry-point fallback)."""
    cost: float
    """Relative cost c_s: flops_per_sample divided by the mean over stages (mean 1)."""
    memory: MemoryNeed
    state_bytes: int
    """θ_global + outer momentum: what a replica downloads to join this stage."""
    method: str
    """"flops" (built-in GPT) or "params" (entry-point fallback)."""

    @property
    def memory_bytes(self) -> int:
        return self.memory.total


def gpt_stage_params(m: Manifest, stage: int) -> int:
    """Parameters of stage ``stage`` of the built-in GPT (matches ``GPTStage``, untied head)."""
    md, layers = m.model, m.layers_per_stage
    d, v, t = md.d_model, md.vocab_size, md.seq_len
    n = layers[stage] * (12 * d * d + 13 * d)  # qkv, proj, fc, proj with biases; two LayerNorms
    if stage == 0:
        n += v * d + t * d
    if stage == len(layers) - 1:
        n += 2 * d + d * v  # ln_f, head (no bias)
    return n


def _gpt_flops(m: Manifest, stage: int) -> float:
    md, layers = m.model, m.layers_per_stage
    d, v, t = md.d_model, md.vocab_size, md.seq_len
    per_token = layers[stage] * (2 * 12 * d * d + 2 * t * d)
    if stage == len(layers) - 1:
        per_token += 2 * d * v
    return 3.0 * per_token * t


def _gpt_activations(m: Manifest, stage: int) -> Activations:
    md, layers = m.model, m.layers_per_stage
    d, v, t = md.d_model, md.vocab_size, md.seq_len
    rest = d  # stage 0: the embedding sum; others: the received input
    if stage == len(layers) - 1:
        rest += 2 * d + 2 * v
    return Activations(rest=FP32 * rest * t, blocks=layers[stage], per_block=FP32 * 16 * d * t,
                       block_input=FP32 * d * t)


@dataclass(frozen=True)
class Activations:
    """What one sample keeps for backward on a stage, in fp32 bytes, by part: ``blocks`` blocks of
    ``per_block`` bytes each, whose input is ``block_input`` bytes, and ``rest`` (the embedding or
    received input, the head and the loss)."""
    rest: int
    blocks: int = 0
    per_block: int = 0
    block_input: int = 0

    def kept(self, bf16: bool, checkpointing: bool) -> int:
        """Bytes kept per sample between a microbatch's forward and its backward."""
        if checkpointing and self.blocks:
            return self.blocks * self.block_input + self.rest
        return self.blocks * (self.per_block // 2 if bf16 else self.per_block) + self.rest

    def rebuilt(self, bf16: bool, checkpointing: bool) -> int:
        """Bytes per sample of the one block a checkpointed backward rebuilds at a time (0 without)."""
        if not (checkpointing and self.blocks):
            return 0
        return self.per_block // 2 if bf16 else self.per_block


def _llama_shape(m: Manifest) -> tuple[int, int, int, int, int]:
    """(d, kv width, SwiGLU width, vocab, seq_len) of a llama manifest (peer/model/llama.py's defaults)."""
    md = m.model
    d = md.d_model
    kv = (md.n_kv_heads or md.n_heads) * (d // md.n_heads)
    ffn = md.ffn_hidden or 256 * ((int(8 * d / 3) + 255) // 256)
    return d, kv, ffn, md.vocab_size, md.seq_len


def llama_stage_params(m: Manifest, stage: int) -> int:
    """Parameters of stage ``stage`` of the llama kind (matches ``LlamaStage``: no biases)."""
    layers = m.layers_per_stage
    d, kv, f, v, _ = _llama_shape(m)
    # boundary_subspace: a stage before the last writes k values (o_proj, down_proj), embeds in k
    k = m.model.boundary_subspace if stage < len(layers) - 1 else 0
    out = k or d
    n = layers[stage] * (d * d + out * d + 2 * d * kv + 2 * d * f + out * f + 2 * d)  # q, o; k, v; gate, up, down; norms
    if stage == 0:
        n += v * (k or d)
    if stage == len(layers) - 1:
        n += d + (0 if m.model.tie_embeddings else d * v)  # norm, lm_head
    return n


def _llama_flops(m: Manifest, stage: int) -> float:
    layers = m.layers_per_stage
    d, kv, f, v, t = _llama_shape(m)
    per_token = layers[stage] * (2 * (2 * d * d + 2 * d * kv + 3 * d * f) + 2 * t * d)
    if stage == len(layers) - 1:
        per_token += 2 * d * v
    return 3.0 * per_token * t


def _llama_activations(m: Manifest, stage: int) -> Activations:
    """Kept for backward per token and layer: the layer input, RMSNorm's normalised and scaled
    outputs (twice), q (roped), k and v, the attention output and its re-laid-out copy, the
    residual after attention (10·d + 2·kv), and the SwiGLU's gate, silu(gate), up and their
    product (4·f). The head keeps the norm's three and the logits and softmax (3·d + 2·V)."""
    layers = m.layers_per_stage
    d, kv, f, v, t = _llama_shape(m)
    rest = d  # stage 0: the embedding output; others: the received input
    if stage == len(layers) - 1:
        rest += 3 * d + 2 * v
    return Activations(rest=FP32 * rest * t, blocks=layers[stage], per_block=FP32 * (10 * d + 2 * kv + 4 * f) * t,
                       block_input=FP32 * d * t)


def _memory(m: Manifest, params: int, acts: Activations, compute_dtype: str | None = None) -> MemoryNeed:
    p = FP32 * params
    in_flight = m.pipeline.max_in_flight * m.inner.microbatch_size
    bf16 = (compute_dtype or m.model.dtype) == "bfloat16"
    ckpt = m.model.activation_checkpointing
    # bf16 weight copies autocast saved for backward: one per microbatch in flight, or with
    # checkpointing only the rebuilt block's (its share of the stage, counted as the whole: an upper bound)
    casts = (params * 2) * (1 if ckpt else m.pipeline.max_in_flight) if bf16 else 0
    activations = (in_flight * acts.kept(bf16, ckpt) + m.inner.microbatch_size * acts.rebuilt(bf16, ckpt)
                   + casts)
    # SwarmAdamW: a third moment (the plain square's EMA) and the step's sum of squared gradients
    adam = (4 if m.inner.swarm_second_moment else 2) * p
    return MemoryNeed(weights=p, theta_global=p, snapshot=2 * p, eval_copy=p, momentum=p, adam=adam, grads=p,
                      residual=p * (int(m.averaging.error_feedback) + int(m.averaging.reducer_feedback)),
                      activations=activations,
                      stash=p if m.pipeline.lookahead and m.stages.count > 1 else 0)


def _spec_bytes(spec: tuple[tuple[int, ...], object]) -> int:
    shape, dtype = spec
    size = getattr(dtype, "itemsize", FP32)
    n = 1
    for dim in shape:
        n *= int(dim)
    return n * int(size)


def stage_costs(manifest: Manifest, model: "StagedModel | None" = None,
                compute_dtype: str | None = None) -> tuple[StageCost, ...]:
    """Cost, memory and state bytes of every stage.

    ``compute_dtype``: what the replica computes in ("float32" or "bfloat16"; default the
    manifest's model.dtype, what a CUDA peer uses). The built-in GPT and the llama kind are computed from
    the manifest alone. An ``entry_point`` model needs its
    ``StagedModel`` (each stage is built once to count its parameters; activations are taken
    as the stage's input and output per sample, a lower bound).

    Raises:
        ValueError: for an entry-point manifest without ``model``, or a model whose stage count
            differs from the manifest's.
    """
    n = manifest.stages.count
    if manifest.model.kind == "gpt":
        params = [gpt_stage_params(manifest, s) for s in range(n)]
        flops = [_gpt_flops(manifest, s) for s in range(n)]
        acts = [_gpt_activations(manifest, s) for s in range(n)]
        method = "flops"
    elif manifest.model.kind == "llama":
        params = [llama_stage_params(manifest, s) for s in range(n)]
        flops = [_llama_flops(manifest, s) for s in range(n)]
        acts = [_llama_activations(manifest, s) for s in range(n)]
        method = "flops"
    else:
        if model is None:
            raise ValueError("stage_costs: an entry_point manifest needs its StagedModel (model=...)")
        if model.n_stages != n:
            raise ValueError(f"stage_costs: model has {model.n_stages} stages, manifest stages.count is {n}")
        params = [sum(p.numel() for p in model.build_stage(s).parameters()) for s in range(n)]
        # A stage without parameters still costs something; floor it so no rate divides by zero.
        flops = [6.0 * max(p, 1) for p in params]
        acts = [Activations(rest=_spec_bytes(model.input_spec(s, 1)) + _spec_bytes(model.output_spec(s, 1)))
                for s in range(n)]
        method = "params"
    mean = sum(flops) / n
    return tuple(StageCost(stage=s, params=params[s], flops_per_sample=flops[s], cost=flops[s] / mean,
                           memory=_memory(manifest, params[s], acts[s], compute_dtype), state_bytes=2 * FP32 * params[s],
                           method=method)
                 for s in range(n))
