"""Stage models: the built-in byte-level GPT and the user-model entry point."""

from .entry import StagedModel, gpt_from_params, gpt_staged_model, load_entry_point
from .gpt import GPTConfig, build_gpt_stage, build_gpt_stages, gpt_loss, split_layers

__all__ = [
    "GPTConfig",
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


def from_manifest(manifest) -> StagedModel:
    """The StagedModel a manifest describes: the built-in GPT or the user's entry point."""
    md = manifest.model
    if md.kind == "gpt":
        cfg = GPTConfig(vocab_size=md.vocab_size, d_model=md.d_model, n_layers=md.n_layers, n_heads=md.n_heads,
                        seq_len=md.seq_len)
        return gpt_staged_model(cfg, manifest.layers_per_stage, manifest.seed)
    return load_entry_point(md.entry_point, dict(md.params), manifest.stages.count, manifest.seed)
