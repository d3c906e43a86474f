"""The benchmarks' single-process training loop: a manifest's model trained in this process, no
network, as the swarm's peers train it.

Everything that decides a step is the peers' own code: the model (`swarmgrad.peer.model.from_manifest`,
stage by stage), one `InnerOptimizer` per stage (each microbatch weighted by its samples, the step's
mean gradient, clipping per stage, AdamW or SwarmAdamW) and the learning rate of the manifest's
schedule at the run's samples (`TrainingProgress`). A benchmark changes what it measures and
nothing else: what travels between the stages (`Trainer.forward`), how a microbatch's gradients
are made (its own loop over `accumulate`/`update`), or where a replica's rounds begin.

The reference task (examples/reference.toml: the byte-level GPT d_model 128, 4 layers, 4 heads,
seq_len 128; AdamW 2e-3, betas (0.9, 0.95), wd 0.1, clip 1.0; warmup then cosine to 10 %) is
`reference`, with its schedule spanning the benchmark's own steps.
"""
from __future__ import annotations

from typing import Sequence

import torch

from benchmarks.harness import REPO
from swarmgrad.peer.compute.inner_optimizer import InnerOptimizer
from swarmgrad.peer.compute.schedule import TrainingProgress
from swarmgrad.peer.data import ByteCorpus, bits_per_byte, load_corpora, validation_batches
from swarmgrad.peer.manifest import InnerOptConfig, Manifest, load
from swarmgrad.peer.model import from_manifest

REFERENCE = REPO / "examples" / "reference.toml"

Batch = tuple[torch.Tensor, torch.Tensor]


def reference(*, stages: int = 1, seed: int = 0, steps: int | None = None, microbatch: int | None = None,
              microbatches: int = 1, warmup_steps: int | None = None, constant_lr: bool = False) -> Manifest:
    """examples/reference.toml in `stages` stages with `seed`; with `steps`, steps of `microbatches`
    x `microbatch` samples whose schedule spans them: warmup over `warmup_steps` (default 10 %),
    then the manifest's cosine to 10 % at the last one (`constant_lr`: the peak lr throughout, no
    warmup)."""
    m = load(REFERENCE).replace(seed=seed, stages={"count": stages})
    if microbatch is not None:
        m = m.replace(inner={"microbatch_size": microbatch, "microbatches_per_step": microbatches})
    if steps is not None:
        per_step = m.inner.microbatch_size * m.inner.microbatches_per_step
        warmup = steps // 10 if warmup_steps is None else warmup_steps
        m = m.replace(schedule={"kind": "constant", "warmup_samples": 0} if constant_lr else
                      {"warmup_samples": warmup * per_step, "total_samples": steps * per_step})
    return m


def reference_data(val_batches: int, max_bytes: int | None = None,
                   seq_len: int = 128) -> tuple[ByteCorpus, list[Batch]]:
    """The stdlib corpus's training bytes (the first `max_bytes` of them, or all) and `val_batches`
    held-out batches of 32 windows: the one evaluation set of the single-process benchmarks."""
    train, val = load_corpora("stdlib", max_bytes=max_bytes)
    return train, validation_batches(val, seq_len, 32, val_batches, seed=0)


class Trainer:
    """The manifest's stages in this process, each with its worker's inner optimiser.

    `step(batches)` is one inner step over a step's microbatches; a benchmark that makes gradients
    its own way calls `accumulate` per microbatch (or adds to `opts[k]` itself) and then `update`.
    The lr of a step is the schedule's at `samples` (the samples this trainer stepped on before it)
    unless the caller passes the swarm's position (`update(at=...)`: replicas sharing one
    `progress`, as in rounds). Built under ``torch.manual_seed(manifest.seed)``, so two trainers of
    one manifest start from the same weights and the global generator in the same state.

    `inner` replaces the manifest's inner optimiser settings where a benchmark's variant is one the
    manifest's checks refuse (SwarmAdamW on steps that the benchmark itself splits in two)."""

    def __init__(self, manifest: Manifest, progress: TrainingProgress | None = None, replicas: int = 1,
                 inner: InnerOptConfig | None = None):
        torch.manual_seed(manifest.seed)
        self.manifest = manifest
        self.model = from_manifest(manifest)
        self.stages = [self.model.build_stage(k).train() for k in range(self.model.n_stages)]
        self.progress = progress or TrainingProgress(manifest.schedule)
        self.opts = [InnerOptimizer(stage, inner or manifest.inner, self.progress) for stage in self.stages]
        for opt in self.opts:
            opt.set_replicas(replicas)
        self.samples = 0

    def params(self) -> list[torch.Tensor]:
        return [p for opt in self.opts for p in opt.params()]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The whole model: every stage in turn (a benchmark puts its boundary between them here)."""
        for stage in self.stages:
            x = stage(x)
        return x

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.model.loss_fn(self.forward(x), y)

    def accumulate(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """One microbatch's gradients into every stage's optimiser, weighted by its samples as the
        last stage weights it (one at a time through SwarmAdamW's `add` when it is on); its loss."""
        loss = self.loss(x, y)
        weighted = self.opts[-1].weighted(loss, len(x))
        if self.opts[0].per_microbatch:
            grads = torch.autograd.grad(weighted, self.params())
            at = 0
            for opt in self.opts:
                n = len(opt.params())
                opt.add([list(grads[at:at + n])], [len(x)])
                at += n
        else:
            weighted.backward()
        return float(loss.detach())

    def update(self, microbatches: int, samples: int, at: float | None = None) -> bool:
        """Every stage's inner step on what was accumulated: `microbatches` of `samples` in all, at
        the lr of position `at` (default: `self.samples`). False if a stage skipped its step (a
        gradient that is not finite)."""
        position = self.samples if at is None else at
        stepped = [opt.step(microbatches, int(position), samples) for opt in self.opts]
        self.samples += samples
        return all(stepped)

    def step(self, batches: Sequence[Batch], at: float | None = None) -> list[float]:
        """One inner step over `batches` (the step's microbatches); their losses."""
        losses = [self.accumulate(x, y) for x, y in batches]
        self.update(len(batches), sum(len(x) for x, _ in batches), at)
        return losses

    def evaluate(self, batches: Sequence[Batch]) -> float:
        """Mean loss over `batches` in bits per byte, in eval mode without gradients."""
        for stage in self.stages:
            stage.eval()
        try:
            with torch.no_grad():
                losses = [float(self.loss(x, y)) for x, y in batches]
        finally:
            for stage in self.stages:
                stage.train()
        return bits_per_byte(sum(losses) / len(losses))
