"""Stage models: the built-in byte-level GPT, the Llama family, and the user-model entry point."""

from pathlib import Path

from .entry import StagedModel, gpt_from_params, gpt_staged_model, load_entry_point
from .gpt import GPTConfig, build_gpt_stage, build_gpt_stages, gpt_loss, split_layers
from .llama import LlamaConfig, build_llama_stage, hf_name, llama_config, llama_staged_model, swarm_name

__all__ = [
    "GPTConfig",
    "LlamaConfig",
    "build_llama_stage",
    "hf_name",
    "llama_config",
    "llama_staged_model",
    "swarm_name",
    "init_from_path",
    "StagedModel",
    "build_gpt_stage",
    "build_gpt_stages",
    "gpt_from_params",
    "gpt_loss",
    "gpt_staged_model",
    "load_entry_point",
    "split_layers",
    "from_manifest",
]


def init_from_path(manifest, base_dir: str | Path | None = None) -> Path | None:
    """``model.init_from`` resolved: relative to ``base_dir`` (the manifest's folder), else to the
    working directory; None when the manifest does not name one."""
    if not manifest.model.init_from:
        return None
    path = Path(manifest.model.init_from).expanduser()
    return path if path.is_absolute() else Path(base_dir or ".") / path


def from_manifest(manifest, base_dir: str | Path | None = None) -> StagedModel:
    """The StagedModel a manifest describes: the built-in GPT, the Llama family or the user's
    entry point. ``base_dir``: the manifest's folder, which a relative ``model.init_from`` is read from."""
    md = manifest.model
    if md.kind == "llama":
        return llama_staged_model(llama_config(md), manifest.layers_per_stage, manifest.seed,
                                  init_from_path(manifest, base_dir))
    if md.kind == "gpt":
        cfg = GPTConfig(vocab_size=md.vocab_size, d_model=md.d_model, n_layers=md.n_layers, n_heads=md.n_heads,
                        seq_len=md.seq_len)
        return gpt_staged_model(cfg, manifest.layers_per_stage, manifest.seed)
    return load_entry_point(md.entry_point, dict(md.params), manifest.stages.count, manifest.seed)
