"""What a replica has trained: the inner step it is filling, the round so far, and ever."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RoundTally:
    """The worker's counts of trained microbatches and inner steps.

    Written on the event loop only, by the worker (`trained` when a microbatch's gradients join
    the accumulation, `stepped` in the step's critical section, `new_round` at a resume); the
    round runner and the driver read it.

    Invariants:
    - `accumulated` and `step_samples` count exactly the microbatches (and their samples) whose
      gradients sit in the accumulation for the next inner step; `stepped` returns both to 0.
    - `samples` and `losses` cover every microbatch trained since the last `new_round` that did
      not carry over; `inner_steps` the steps since the last `new_round`.
    - `steps_total` and `skipped_steps` never decrease; `steps_total` grows with `inner_steps`,
      one per step, so a slot's `step` compared with it says whether that step has been applied.
    - `microbatches_total` never decreases: one per `trained`.
    """
    accumulated: int = 0
    """Microbatches whose gradients sit in .grad, waiting for the next inner step."""
    step_samples: int = 0
    """Their samples (the step divides the summed gradients by these, in microbatch_size units)."""
    inner_steps: int = 0
    """Inner steps since the last round boundary."""
    steps_total: int = 0
    """Inner steps ever (an overlapped round asks whether θ_local moved since its snapshot)."""
    samples: int = 0
    """Samples trained on since the last round boundary (the averaging weight)."""
    losses: list[float] = field(default_factory=list)
    """Losses of microbatches since the last round boundary (known at the last stage and at drivers)."""
    skipped_steps: int = 0
    """Inner steps skipped because a gradient was not finite (reported in round events)."""
    microbatches_total: int = 0
    """Microbatches trained ever: each went forward and back through every stage, so its growth
    shows the whole pipeline served (placement's evidence that a stage of one replica is served)."""

    def trained(self, batch: int) -> None:
        """A microbatch of `batch` samples joined the accumulation."""
        self.accumulated += 1
        self.microbatches_total += 1
        self.step_samples += batch
        self.samples += batch

    def stepped(self, applied: bool) -> None:
        """An inner step consumed the accumulation (`applied` False: skipped, a non-finite gradient)."""
        self.accumulated = self.step_samples = 0
        self.steps_total += 1
        self.inner_steps += 1
        self.skipped_steps += int(not applied)

    def new_round(self, carry_over: bool) -> None:
        """A round begins. With carry_over (a round that applied nothing) the round's samples and
        losses keep counting into the next round's, since θ_local still holds their work."""
        self.inner_steps = 0
        if not carry_over:
            self.samples = 0
            self.losses = []
