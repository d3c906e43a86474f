"""`swarmgrad export --format hf`: a llama run's model as a Hugging Face checkpoint folder, from a
coordinator's state dir (its newest checkpoint) or from peers' `--save-dir` folders (the newest
round that every stage has); and `swarmgrad generate`, which continues a prompt with such a
folder through transformers (docs/models.md)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

SAVE_FILE_PREFIX = "stage"


class ExportError(ValueError):
    """An export that cannot be made; the message says what to give instead."""


def save_dir_tensors(dirs: list[Path], n_stages: int) -> tuple[int, dict[int, dict[str, Any]]]:
    """(round, {stage: θ_global}) of the newest round every stage has a file of in `dirs`.

    Peers' `--save-dir` files are `stage{s}-{peer}.safetensors` (peer/rounds/runner.py), each the
    replica's last committed state; replicas of a stage at one round hold the same θ_global, so
    any one of them is taken.

    Raises:
        ExportError: a folder that does not exist, a stage with no file, or no round all stages share.
    """
    from safetensors import safe_open
    import json

    from swarmgrad.peer.state.stage_state import load_checkpoint
    found: dict[int, dict[int, Path]] = {}
    for folder in dirs:
        if not folder.is_dir():
            raise ExportError(f"--save-dir {folder} is not a folder")
        for path in sorted(folder.glob(f"{SAVE_FILE_PREFIX}*-*.safetensors")):
            with safe_open(str(path), framework="pt") as f:
                meta = json.loads((f.metadata() or {}).get("swarmgrad", "{}"))
            try:
                stage, round_no = int(meta["stage"]), int(meta["round"])
            except (KeyError, ValueError):
                continue  # not a peer's save file
            found.setdefault(stage, {}).setdefault(round_no, path)
    missing = [s for s in range(n_stages) if s not in found]
    if missing:
        raise ExportError(f"no save file of stage(s) {missing} in {', '.join(map(str, dirs))} "
                          f"(files stage{{s}}-{{peer}}.safetensors, written by `swarmgrad peer --save-dir`)")
    common = set.intersection(*(set(found[s]) for s in range(n_stages)))
    if not common:
        have = "; ".join(f"stage {s}: rounds {sorted(found[s])}" for s in range(n_stages))
        raise ExportError(f"the stages have no round in common ({have}): each file holds a replica's last "
                          "round; export again once the peers have saved the next round")
    round_no = max(common)
    return round_no, {s: load_checkpoint(found[s][round_no])[0] for s in range(n_stages)}


def _tokenizer_of(manifest, override: str | None) -> Path | None:
    """The run's BPE tokenizer file (`--tokenizer`, else the manifest's resolved `data.tokenizer`),
    or None for byte-level data."""
    if override:
        path = Path(override)
    else:
        named = getattr(manifest.data, "tokenizer", "")
        if not named:
            return None
        path = Path(named)
    if not path.is_file():
        raise ExportError(f"tokenizer {path} not found: pass --tokenizer PATH (the run's tokenizer.json)")
    return path


def export_hf(args: argparse.Namespace) -> str:
    """Write the folder; returns the line to print. Raises ExportError, FileNotFoundError, ManifestError."""
    from swarmgrad.peer.manifest import load, loads
    from swarmgrad.peer.model.hf import write_hf_folder
    from swarmgrad.peer.model.llama import llama_config
    if bool(args.state_dir) == bool(args.save_dir):
        raise ExportError("give one source: --state-dir DIR (a coordinator's) or --save-dir DIR [DIR ...] (peers')")
    if args.state_dir:
        from swarmgrad.peer.coordinator.checkpoints import checkpoint_tensors
        round_no, _, manifest_toml, stages = checkpoint_tensors(Path(args.state_dir), args.round)
        manifest = load(args.manifest) if args.manifest else loads(manifest_toml)
        source = f"the checkpoint of round {round_no} in {args.state_dir}"
    else:
        if not args.manifest:
            raise ExportError("--save-dir needs --manifest PATH: the peers' files hold tensors, the manifest the "
                              "model's shape")
        if args.round is not None:
            raise ExportError("--round is for --state-dir; --save-dir exports the newest round every stage has")
        manifest = load(args.manifest)
        round_no, stages = save_dir_tensors([Path(d) for d in args.save_dir], manifest.stages.count)
        source = f"round {round_no} of the peers' save files"
    if manifest.model.kind != "llama":
        raise ExportError(f"--format hf needs model.kind = \"llama\" (this run's is {manifest.model.kind!r}); "
                          "the default format writes any model to one safetensors file")
    if sorted(stages) != list(range(manifest.stages.count)):
        raise ExportError(f"found stages {sorted(stages)}, the manifest has {manifest.stages.count}")
    tensors = {name: t for params in stages.values() for name, t in params.items()}
    out = Path(args.out)
    tokenizer = _tokenizer_of(manifest, args.tokenizer)
    try:
        write_hf_folder(out, llama_config(manifest.model), tensors, tokenizer,
                        metadata={"run_id": manifest.run_id, "round": str(round_no), "manifest_hash": manifest.hash},
                        seed=manifest.seed)
    except ValueError as e:  # tensors of another manifest's model
        raise ExportError(f"{source}: {e}") from None
    return f"wrote {out}: a Hugging Face LlamaForCausalLM folder from {source}"


def cmd_generate(args: argparse.Namespace) -> int:
    """Print the prompt and its continuation by the model in `--model DIR` (needs transformers)."""
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError:
        print("swarmgrad generate needs transformers: pip install 'swarmgrad[hf]'", file=sys.stderr)
        return 2
    if args.max_new_tokens < 1 or args.temperature < 0:
        print("--max-new-tokens must be >= 1 and --temperature >= 0 (0: greedy)", file=sys.stderr)
        return 2
    folder = Path(args.model)
    if not (folder / "config.json").is_file():
        print(f"--model {folder}: no config.json there (a folder `swarmgrad export --format hf` writes)",
              file=sys.stderr)
        return 2
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder))
    model.eval()
    ids = tokenizer(args.prompt, return_tensors="pt").input_ids
    if ids.shape[1] == 0:
        print("--prompt is empty after tokenization: give some text", file=sys.stderr)
        return 2
    torch.manual_seed(args.seed)
    sample = args.temperature > 0
    kwargs: dict[str, Any] = {"do_sample": sample, "max_new_tokens": args.max_new_tokens,
                              "pad_token_id": model.generation_config.eos_token_id or 0}
    if sample:
        kwargs["temperature"] = args.temperature
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    print(args.prompt + tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True), flush=True)
    return 0
