"""The pipeline's math is exact: with one replica per stage, H = 1, outer lr 1 and no momentum, a
round of the swarm equals one plain AdamW step of the whole model on the same microbatches, also
when they differ in size (inner.microbatch_sizes: the step is the mean over its samples). The
swarm is real peers in one event loop (tests/support/swarm.py): the driver's microbatches cross
the loopback transport encoded as on the wire."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from swarmgrad.peer.data import MicrobatchStream, load_corpora
from swarmgrad.peer.model import from_manifest

from support.swarm import exact_round_manifest, one_saved_round, saved_round

DATA_SEED = 1234


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sizes,checkpointing", [((), False), ((1, 4, 2), False), ((), True)],
                         ids=["equal", "tapered", "checkpointed"])
def test_one_round_equals_one_whole_model_step(inprocess, tmp_path: Path, sizes: tuple[int, ...],
                                               checkpointing: bool) -> None:
    """Replaces the real-process version of this test (the same manifest and assertions). With
    model.activation_checkpointing the stages recompute their blocks in the backward: the same step."""
    m = exact_round_manifest(tmp_path, model={"activation_checkpointing": checkpointing},
                             inner={"microbatches_per_step": 3, "microbatch_sizes": list(sizes)},
                             pipeline={"max_in_flight": 3})
    saves = inprocess(lambda: one_saved_round(m, tmp_path, DATA_SEED))

    # the reference: the whole model, the same first microbatches of the driver's shard (drawn in
    # the order of their places in the step, each at its place's size), one AdamW step on the mean
    # over their samples
    model = from_manifest(m)
    stages = [model.build_stage(s) for s in range(model.n_stages)]
    whole = torch.nn.Sequential(*stages)
    train, _ = load_corpora(m.data.source, m.data.paths, m.data.val_fraction, None)
    stream = MicrobatchStream(train, m.model.seq_len, m.inner.microbatch_size, DATA_SEED)
    batches = [stream.draw(n) for n in m.inner.step_sizes]
    opt = torch.optim.AdamW(whole.parameters(), lr=m.inner.lr, betas=m.inner.betas, weight_decay=m.inner.weight_decay)
    # Σ n_i·loss_i / Σ n_i, in the pipeline's units of a full microbatch (exact factors for equal
    # ones; for others the same rounding as the stages', since AdamW's first step amplifies the
    # rounding of a gradient element near 0 up to lr)
    full = m.inner.microbatch_size
    loss = sum((x.shape[0] / full) * model.loss_fn(whole(x), y) for x, y in batches)
    loss.backward()
    for p in whole.parameters():
        p.grad.mul_(1.0 / (m.inner.step_samples / full))
    opt.step()

    for s, stage in enumerate(stages):
        params = saved_round(saves[s], s)
        for name, p in stage.named_parameters():
            torch.testing.assert_close(params[name], p.detach(), rtol=1e-5, atol=1e-6,
                                       msg=lambda msg: f"stage {s} {name}: {msg}")
        # and the step really moved the weights (the comparison is not trivially true)
        fresh = dict(model.build_stage(s).named_parameters())
        assert any(not torch.equal(params[n], fresh[n].detach()) for n in params)
