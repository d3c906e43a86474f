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
from swarmgrad.peer.state.stage_state import load_checkpoint

from conftest import small_manifest
from support.swarm import InProcessSwarm

DATA_SEED = 1234


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sizes,checkpointing", [((), False), ((1, 4, 2), False), ((), True)],
                         ids=["equal", "tapered", "checkpointed"])
def test_one_round_equals_one_whole_model_step(inprocess, tmp_path: Path, sizes: tuple[int, ...],
                                               checkpointing: bool) -> None:
    """Replaces the real-process version of this test (the same manifest and assertions). With
    model.activation_checkpointing the stages recompute their blocks in the backward: the same step."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(b"".join(p.read_bytes() for p in sorted(Path(torch.__file__).parent.glob("*.py"))[:20]))
    m = small_manifest(
        model={"activation_checkpointing": checkpointing},
        inner={"lr": 1e-3, "grad_clip": 0.0, "weight_decay": 0.1, "microbatch_size": 4, "microbatches_per_step": 3,
               "microbatch_sizes": list(sizes)},
        outer={"lr": 1.0, "momentum": 0.0, "nesterov": False},
        rounds={"inner_steps": 1, "round_seconds": 0.0},
        averaging={"codec": "fp32"},
        pipeline={"activation_codec": "fp32", "gradient_codec": "fp32", "max_in_flight": 3},
        data={"source": "files", "paths": [str(corpus)], "max_bytes": 0, "eval_batches": 1, "eval_every": 0},
    )

    async def scenario() -> list[Path]:
        async with InProcessSwarm(m, tmp_path=tmp_path) as swarm:
            peers = [swarm.start(s, max_rounds=1, data_seed=DATA_SEED, save=True, linger=5.0) for s in (0, 1)]
            await swarm.wait_exit(60)
            return [Path(p.peer.opt.save_dir) for p in peers]  # type: ignore[union-attr,arg-type]

    saves = inprocess(scenario)

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
        files = list(saves[s].glob(f"stage{s}-*.safetensors"))
        assert len(files) == 1, files
        params, _, meta = load_checkpoint(files[0])
        assert meta["applied_rounds"] == "1"
        for name, p in stage.named_parameters():
            torch.testing.assert_close(params[name], p.detach(), rtol=1e-5, atol=1e-6,
                                       msg=lambda msg: f"stage {s} {name}: {msg}")
        # and the step really moved the weights (the comparison is not trivially true)
        fresh = dict(model.build_stage(s).named_parameters())
        assert any(not torch.equal(params[n], fresh[n].detach()) for n in params)
