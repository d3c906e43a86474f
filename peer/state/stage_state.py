"""Stage state: θ_global, the outer optimiser and the agreed counters behind them (outer steps, samples).

θ_global lives on the CPU in fp32 whatever the device of the module: it is what the replicas
of a stage agree on bit for bit after every round, and the outer step is run by identical CPU
code on identical inputs so that agreement survives it. `digest` names a state; replicas
compare digests before they average and after, and one whose digest differs re-syncs.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from swarmgrad.peer.manifest import OuterOptConfig


@dataclass(frozen=True)
class StateSnapshot:
    """An immutable copy of a committed state, safe to serve while training goes on."""
    params: dict[str, torch.Tensor]
    momentum: dict[str, torch.Tensor]
    round: int
    """The first round this state is ready for."""
    applied_rounds: int
    digest: str
    trained_samples: int = 0
    """Samples the stage group averaged into this state: the schedule's agreed position."""


def state_digest(params: dict[str, torch.Tensor], momentum: dict[str, torch.Tensor], trained_samples: int = 0) -> str:
    h = hashlib.blake2b(digest_size=12)
    if trained_samples:  # part of the agreed state: the lr schedule's position (0 keeps older digests)
        h.update(f"samples:{int(trained_samples)}".encode())
    for prefix, tensors in (("p", params), ("m", momentum)):
        for name in sorted(tensors):
            h.update(f"{prefix}:{name}:{tuple(tensors[name].shape)}".encode())
            h.update(tensors[name].detach().contiguous().numpy().tobytes())
    return h.hexdigest()


class StageState:
    def __init__(self, module: nn.Module, outer: OuterOptConfig):
        self.names = [name for name, _ in module.named_parameters()]
        self.shapes = {name: tuple(p.shape) for name, p in module.named_parameters()}
        self.params = {name: p.detach().to("cpu", torch.float32).clone().requires_grad_(True)
                       for name, p in module.named_parameters()}
        self._outer_cfg = outer
        self.outer_opt = self._make_outer()
        self.applied_rounds = 0
        """How many outer steps produced θ_global (0: the initialisation)."""
        self.trained_samples = 0
        """Samples the stage group averaged into θ_global (the sum of complete rounds' weights)."""
        self.digest = ""
        self.snapshot: StateSnapshot | None = None
        self.commit(0)

    def _make_outer(self) -> torch.optim.SGD:
        cfg = self._outer_cfg
        # foreach=False: one code path everywhere, so every replica computes bit-identical updates
        return torch.optim.SGD([self.params[n] for n in self.names], lr=cfg.lr, momentum=cfg.momentum,
                               nesterov=cfg.nesterov and cfg.momentum > 0, foreach=False)

    def momentum(self) -> dict[str, torch.Tensor]:
        out = {}
        for name in self.names:
            buf = self.outer_opt.state.get(self.params[name], {}).get("momentum_buffer")
            if buf is not None:
                out[name] = buf
        return out

    def commit(self, round_no: int) -> None:
        """Recompute the digest and freeze a snapshot for state download, ready for `round`."""
        params = {n: p.detach().clone() for n, p in self.params.items()}
        momentum = {n: m.detach().clone() for n, m in self.momentum().items()}
        self.digest = state_digest(params, momentum, self.trained_samples)
        self.snapshot = StateSnapshot(params, momentum, round_no, self.applied_rounds, self.digest, self.trained_samples)

    def pseudo_gradient(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """Δ = θ_global − θ_local, fp32 on the CPU."""
        local = dict(module.named_parameters())
        return {n: self.params[n].detach() - local[n].detach().to("cpu", torch.float32) for n in self.names}

    def apply_outer(self, mean_delta: dict[str, torch.Tensor], total_weight: float = 0.0,
                    lr_multiplier: float = 1.0) -> None:
        """θ_global ← OuterOpt(θ_global, mean Δ) with outer lr × `lr_multiplier`; `total_weight`
        samples join trained_samples. The caller commits."""
        for group in self.outer_opt.param_groups:
            group["lr"] = self._outer_cfg.lr * lr_multiplier
        for name in self.names:
            self.params[name].grad = mean_delta[name].to(torch.float32).clone()
        self.outer_opt.step()
        self.outer_opt.zero_grad(set_to_none=True)
        self.applied_rounds += 1
        self.trained_samples += int(round(total_weight))

    def copy_to(self, module: nn.Module) -> None:
        with torch.no_grad():
            for name, p in module.named_parameters():
                p.copy_(self.params[name].detach().to(p.device, p.dtype))

    def load(self, params: dict[str, torch.Tensor], momentum: dict[str, torch.Tensor], round_no: int,
             applied_rounds: int, trained_samples: int = 0) -> None:
        """Adopt a state downloaded from another replica (names and shapes already validated)."""
        with torch.no_grad():
            for name in self.names:
                self.params[name].copy_(params[name])
        self.outer_opt = self._make_outer()
        for name, buf in momentum.items():
            self.outer_opt.state[self.params[name]]["momentum_buffer"] = buf.detach().clone()
        self.applied_rounds = applied_rounds
        self.trained_samples = trained_samples
        self.commit(round_no)

    def save(self, path: str | Path, extra: dict[str, str] | None = None) -> None:
        """A safetensors checkpoint of the committed state (θ_global and outer momentum)."""
        from safetensors.torch import save_file
        snap = self.snapshot
        assert snap is not None
        tensors = {f"global.{n}": t.contiguous() for n, t in snap.params.items()}
        tensors.update({f"momentum.{n}": t.contiguous() for n, t in snap.momentum.items()})
        meta = {"round": str(snap.round), "applied_rounds": str(snap.applied_rounds), "digest": snap.digest,
                "trained_samples": str(snap.trained_samples)}
        meta.update(extra or {})
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        # never half-written: a crash mid-save leaves the previous checkpoint in place
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            save_file(tensors, str(tmp), metadata={"swarmgrad": json.dumps(meta)})
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)


def load_checkpoint(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict]:
    """(θ_global, momentum, metadata) from a checkpoint written by StageState.save."""
    from safetensors import safe_open
    params, momentum = {}, {}
    with safe_open(str(path), framework="pt") as f:
        meta = json.loads((f.metadata() or {}).get("swarmgrad", "{}"))
        for key in f.keys():
            kind, name = key.split(".", 1)
            (params if kind == "global" else momentum)[name] = f.get_tensor(key)
    return params, momentum, meta


class CheckpointError(ValueError):
    """A checkpoint that does not fit this stage or does not match its own digest."""


def snapshot_bytes(snap: StateSnapshot, extra: dict[str, str] | None = None) -> bytes:
    """A committed state as a safetensors file (the layout StageState.save writes), in memory."""
    from safetensors.torch import save
    tensors = {f"global.{n}": t.contiguous() for n, t in snap.params.items()}
    tensors.update({f"momentum.{n}": t.contiguous() for n, t in snap.momentum.items()})
    meta = {"round": str(snap.round), "applied_rounds": str(snap.applied_rounds), "digest": snap.digest,
            "trained_samples": str(snap.trained_samples), **(extra or {})}
    return save(tensors, metadata={"swarmgrad": json.dumps(meta)})


def snapshot_from_bytes(data: bytes, shapes: dict[str, tuple[int, ...]]) -> StateSnapshot:
    """A checkpoint's state, checked against the stage it is for: the same tensor names and
    shapes, fp32, finite, and a recomputed digest equal to the one it declares. Raises
    CheckpointError."""
    from safetensors import SafetensorError
    from safetensors.torch import load
    try:
        tensors = load(data)
    except SafetensorError as e:
        raise CheckpointError(f"not a safetensors file: {type(e).__name__}: {e}") from None
    meta = _safetensors_metadata(data)
    params = {k.split(".", 1)[1]: t for k, t in tensors.items() if k.startswith("global.")}
    momentum = {k.split(".", 1)[1]: t for k, t in tensors.items() if k.startswith("momentum.")}
    if set(params) != set(shapes) or not set(momentum) <= set(shapes) or len(params) + len(momentum) != len(tensors):
        raise CheckpointError("its tensors are not this stage's")
    for name, t in [*params.items(), *momentum.items()]:
        if tuple(t.shape) != tuple(shapes[name]) or t.dtype != torch.float32 or not torch.isfinite(t).all():
            raise CheckpointError(f"tensor {name}: wrong shape or dtype, or not finite")
    try:
        round_, applied, trained = int(meta["round"]), int(meta["applied_rounds"]), int(meta["trained_samples"])
        declared = str(meta["digest"])
    except (KeyError, TypeError, ValueError):
        raise CheckpointError("its metadata lacks round, applied_rounds, trained_samples or digest") from None
    if min(round_, applied, trained) < 0:
        raise CheckpointError("negative counters")
    digest = state_digest(params, momentum, trained)
    if digest != declared:
        raise CheckpointError("its tensors do not match the digest it declares")
    return StateSnapshot(params, momentum, round_, applied, digest, trained)


def _safetensors_metadata(data: bytes) -> dict:
    """The swarmgrad metadata in a safetensors header (8-byte length, then JSON)."""
    if len(data) < 8:
        raise CheckpointError("truncated")
    n = int.from_bytes(data[:8], "little")
    if n > min(len(data) - 8, 100 << 20):
        raise CheckpointError("bad header length")
    try:
        header = json.loads(data[8:8 + n])
        return json.loads(header.get("__metadata__", {}).get("swarmgrad", "{}"))
    except (ValueError, AttributeError):
        raise CheckpointError("unreadable header") from None
