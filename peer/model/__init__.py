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
]
