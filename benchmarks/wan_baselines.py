"""The WAN benchmark's baselines, one training process per rank (run by benchmarks.wan inside a
network namespace): `torch.distributed` DDP (gloo, fp32 all-reduce every step) and
`hivemind.Optimizer`, synchronous (fp16 gradients averaged every global batch) or with local updates
(parameters averaged every `--average-every` steps, fp16).

Every system trains the same model (the manifest's GPT with one stage, same seed), with the same
AdamW, gradient clipping and lr schedule (the manifest's over the samples of the whole run), on
random windows of the same training bytes: the model, the data stream and the lr come from the
benchmarks' training loop (benchmarks/harness/training.py), and DDP's step is the swarm workers'
inner optimiser's (hivemind.Optimizer brings its own AdamW, at that lr). Rank 0 saves its weights every `--ckpt-every`
steps with a wall-clock stamp; wan.py scores them afterwards, with the same code for every system.
Each process appends JSON lines to `--events`: `ready`, `ckpt` (step, samples, time, path) and
`done` (CPU seconds of this process, steps).

    python -m benchmarks.wan_baselines --system ddp|hm-sync|hm-local --rank R --addr IP ...
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from benchmarks.harness.training import Trainer
from swarmgrad.peer.data import ByteCorpus, MicrobatchStream
from swarmgrad.peer.manifest import load

SYSTEMS = ("ddp", "hm-sync", "hm-local")


def _emit(events_path: Path, event: str, **fields: object) -> None:
    with open(events_path, "a") as f:
        f.write(json.dumps({"event": event, "time": time.time(), **fields}) + "\n")


def patch_mp_pipe_nonblocking_recv() -> None:
    """hivemind 1.1.12 under uvloop sets its DHT/averager pipes O_NONBLOCK; a message over 16 KiB then
    hits EAGAIN mid-read and the child dies (hivemind PR #660, see the primer §9.2). Wait instead."""
    import io
    import multiprocessing.connection as mpc
    import select

    def _recv(self, size, read=os.read):  # type: ignore[no-untyped-def]
        buf, handle, remaining = io.BytesIO(), self._handle, size
        while remaining > 0:
            try:
                chunk = read(handle, remaining)
            except BlockingIOError:
                select.select([handle], [], [])
                continue
            if not chunk:
                if remaining == size:
                    raise EOFError
                raise OSError("got end of file during message")
            buf.write(chunk)
            remaining -= len(chunk)
        return buf

    mpc.Connection._recv = _recv


class Baseline:
    """The loop every baseline shares; `step_fn(loss, step)` does what differs (backward, sync, step)."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        m = load(args.manifest)
        if m.stages.count != 1:
            raise ValueError("the baselines train the whole model: give a manifest with stages.count = 1")
        # one microbatch of --batch per step: the step's mean gradient is this rank's batch's
        self.trainer = Trainer(m.replace(inner={"microbatch_size": args.batch, "microbatches_per_step": 1}))
        self.m = self.trainer.manifest
        self.model = self.trainer.stages[0]
        self.net: torch.nn.Module = self.model  # what the loop calls: DDP wraps it
        corpus = ByteCorpus(torch.load(args.train_bytes))
        self.stream = MicrobatchStream(corpus, self.m.model.seq_len, args.batch, seed=1000 + args.rank)
        self.events = Path(args.events)
        self.ckpt_dir = Path(args.ckpt_dir)
        self.global_batch = args.batch * args.world

    def samples(self, step: int) -> int:
        """Samples of the whole run before `step`: the schedule's position."""
        return step * self.global_batch

    def lr(self, step: int) -> float:
        return self.m.inner.lr * self.trainer.progress.multiplier(self.samples(step))

    def checkpoint(self, step: int) -> None:
        if self.args.rank != 0 or (step % self.args.ckpt_every and step != self.args.steps):
            return
        path = self.ckpt_dir / f"step{step:05d}.pt"
        state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        stamp = time.time()
        torch.save(state, path)
        _emit(self.events, "ckpt", step=step, samples=step * self.global_batch, ckpt_time=stamp, path=str(path))

    def run(self, step_fn, done_info=dict) -> None:  # type: ignore[no-untyped-def]
        cpu0 = time.process_time()
        _emit(self.events, "ready", rank=self.args.rank)
        for step in range(self.args.steps):
            x, y = next(self.stream)
            loss = self.trainer.model.loss_fn(self.net(x), y)
            step_fn(loss, step)
            self.checkpoint(step + 1)
        # CPU seconds since the process started (imports included, as psutil counts swarmgrad's peers)
        _emit(self.events, "done", rank=self.args.rank, steps=self.args.steps, cpu_s=time.process_time(),
              loop_cpu_s=time.process_time() - cpu0, **done_info())


def run_ddp(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    t = Baseline(args)
    dist.init_process_group("gloo", init_method=f"tcp://{args.master}:{args.port}", rank=args.rank,
                            world_size=args.world)
    t.net = DistributedDataParallel(t.model)
    opt = t.trainer.opts[0]  # the workers' step: finiteness, mean, clipping, the schedule's lr, AdamW

    def step(loss: torch.Tensor, index: int) -> None:
        loss.backward()  # DDP's hooks all-reduce (fp32, bucketed) during backward
        opt.step(1, t.samples(index), args.batch)

    try:
        t.run(step)
    finally:
        dist.destroy_process_group()


def run_hivemind(args: argparse.Namespace) -> None:
    patch_mp_pipe_nonblocking_recv()
    import hivemind
    from hivemind.compression import Float16Compression
    from hivemind.utils import get_dht_time

    t = Baseline(args)
    c = t.m.inner
    dht = hivemind.DHT(start=True, host_maddrs=[f"/ip4/{args.addr}/tcp/0"], initial_peers=args.initial_peers)
    if args.maddrs_out:
        Path(args.maddrs_out).write_text(json.dumps([str(a) for a in dht.get_visible_maddrs()]))
    # a barrier: both peers in the DHT before either steps, or the first one runs epochs alone
    key = f"{args.run_id}_ready"
    dht.store(key, subkey=args.rank, value=True, expiration_time=get_dht_time() + 3600)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        found = dht.get(key, latest=True)
        if found is not None and len(found.value) >= args.world:
            break
        time.sleep(0.2)
    else:
        raise TimeoutError("hivemind peers did not all join within 120 s")
    local = args.system == "hm-local"
    opt = hivemind.Optimizer(
        dht=dht, run_id=args.run_id, batch_size_per_step=args.batch,
        target_batch_size=t.global_batch * (args.average_every if local else 1),
        optimizer=lambda params: torch.optim.AdamW(params, lr=c.lr, betas=tuple(c.betas), weight_decay=c.weight_decay),
        params=t.model.parameters(), use_local_updates=local,
        matchmaking_time=args.matchmaking_time, averaging_timeout=60.0,
        grad_compression=Float16Compression(), state_averaging_compression=Float16Compression(),
        tracker_opts=dict(min_refresh_period=0.05, max_refresh_period=0.5), verbose=False,
    )
    inner = opt.state_averager.optimizer

    def step(loss: torch.Tensor, index: int) -> None:
        loss.backward()
        if c.grad_clip > 0:  # sync mode: clips each peer's gradient before averaging
            torch.nn.utils.clip_grad_norm_(t.model.parameters(), c.grad_clip)
        for g in inner.param_groups:
            g["lr"] = t.lr(index)
        opt.step()
        opt.zero_grad()

    try:
        t.run(step, lambda: {"epochs": opt.local_epoch})
    finally:
        opt.shutdown()
        dht.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--system", choices=SYSTEMS, required=True)
    p.add_argument("--manifest", required=True)
    p.add_argument("--train-bytes", required=True, help="torch.save'd uint8 tensor of the training bytes")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--batch", type=int, default=32, help="sequences per step per process")
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--ckpt-every", type=int, default=25)
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--events", required=True)
    p.add_argument("--addr", required=True, help="this process's address (its namespace's wan0)")
    p.add_argument("--master", default=None, help="ddp: rank 0's address")
    p.add_argument("--port", type=int, default=29511)
    p.add_argument("--initial-peers", nargs="*", default=[])
    p.add_argument("--maddrs-out", default=None, help="hivemind: write this DHT's multiaddrs here")
    p.add_argument("--run-id", default="wan")
    p.add_argument("--average-every", type=int, default=50, help="hm-local: steps between parameter averages")
    p.add_argument("--matchmaking-time", type=float, default=1.0)
    args = p.parse_args()
    torch.set_num_threads(1)
    Path(args.ckpt_dir).mkdir(parents=True, exist_ok=True)
    if args.system == "ddp":
        run_ddp(args)
    else:
        run_hivemind(args)
    sys.stdout.flush()
    os._exit(0)  # hivemind's children and atexit hooks can hang an orderly exit; everything is written


if __name__ == "__main__":
    main()
