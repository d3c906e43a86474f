"""Hugging Face interop of the Llama kind: a checkpoint folder out, a checkpoint folder in.

Out (``write_hf_folder``): ``config.json`` (``LlamaForCausalLM``), ``model.safetensors`` (fp32,
Hugging Face names), ``generation_config.json`` and a tokenizer (``tokenizer.json`` +
``tokenizer_config.json``): the run's BPE tokenizer file when the manifest names one, else a
byte tokenizer whose ids are the raw bytes, as the byte-level data feeds them. The folder loads
with ``transformers.AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer``; writing it
needs only safetensors and tokenizers, not transformers.

In (``check_hf_config``, ``load_stage_tensors``): a folder in that format (one
``model.safetensors`` or shards with ``model.safetensors.index.json``), its shapes checked
against the manifest, and only the tensors of one stage read (safetensors reads a subset
without loading the rest).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Mapping

import torch

from .llama import LlamaConfig, LlamaStage, hf_name

__all__ = ["HFCheckpointError", "hf_config", "check_hf_config", "load_stage_tensors", "write_hf_folder",
           "byte_tokenizer_json"]

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"


class HFCheckpointError(ValueError):
    """A checkpoint folder that does not fit the manifest (the message names the field)."""


def hf_config(cfg: LlamaConfig, *, bos_token_id: int | None = None, eos_token_id: int | None = None) -> dict:
    """The ``config.json`` of a ``LlamaForCausalLM`` with this shape."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ffn,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.seq_len,
        "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "torch_dtype": "float32",
    }


def _read_config(folder: Path) -> dict:
    path = folder / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise HFCheckpointError(f"model.init_from {folder}: no config.json there (a Hugging Face checkpoint "
                                "folder, as `swarmgrad export --format hf` writes)") from None
    except json.JSONDecodeError as e:
        raise HFCheckpointError(f"model.init_from {folder}: config.json is not JSON: {e}") from None


def check_hf_config(folder: Path, cfg: LlamaConfig) -> None:
    """Refuse a checkpoint whose architecture or shape differs from the manifest's, naming both.

    Raises:
        HFCheckpointError: not a Llama checkpoint, rope scaling (not implemented here), or a field
            that differs from the manifest's.
    """
    c = _read_config(folder)
    if c.get("model_type") != "llama":
        raise HFCheckpointError(f"model.init_from {folder}: model_type is {c.get('model_type')!r}; only Llama-"
                                "architecture checkpoints (model_type \"llama\") can start a llama run")
    rope_type = (c.get("rope_parameters") or {}).get("rope_type", "default")  # transformers >= 5 writes this
    if c.get("rope_scaling") or rope_type != "default":
        raise HFCheckpointError(f"model.init_from {folder}: rope scaling ({c.get('rope_scaling') or rope_type!r}) "
                                "is not supported: the llama kind uses plain rotary embeddings")
    if c.get("attention_bias") or c.get("mlp_bias"):
        raise HFCheckpointError(f"model.init_from {folder}: biases in attention or MLP are not supported")
    want = hf_config(cfg)
    pairs = (("hidden_size", "d_model"), ("num_hidden_layers", "n_layers"), ("num_attention_heads", "n_heads"),
             ("num_key_value_heads", "n_kv_heads"), ("intermediate_size", "ffn_hidden"), ("vocab_size", "vocab_size"))
    for key, field in pairs:
        have = c.get(key, c.get("num_attention_heads") if key == "num_key_value_heads" else None)
        if have != want[key]:
            raise HFCheckpointError(f"model.init_from {folder}: config.json {key} is {have} but model.{field} "
                                    f"gives {want[key]}; set model.{field} = {have}")
    if c.get("head_dim", want["head_dim"]) != want["head_dim"]:
        raise HFCheckpointError(f"model.init_from {folder}: head_dim {c['head_dim']} is not hidden_size / "
                                "num_attention_heads, which the llama kind assumes")
    if cfg.tie_embeddings and not c.get("tie_word_embeddings", False):
        raise HFCheckpointError(f"model.init_from {folder}: the checkpoint's head is its own (tie_word_embeddings "
                                "false) but model.tie_embeddings = true would drop it; set tie_embeddings = false")
    for key, field in (("rope_theta", "rope_theta"), ("rms_norm_eps", "norm_eps")):
        have = c.get(key, (c.get("rope_parameters") or {}).get(key))
        if have is not None and abs(float(have) - want[key]) > 1e-12 * max(1.0, abs(want[key])):
            raise HFCheckpointError(f"model.init_from {folder}: config.json {key} is {have} but model.{field} "
                                    f"is {want[key]}; set model.{field} = {have}")


def _weight_files(folder: Path) -> dict[str, Path]:
    """Hugging Face tensor name -> the safetensors file holding it."""
    index = folder / INDEX
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    single = folder / WEIGHTS
    if not single.exists():
        raise HFCheckpointError(f"model.init_from {folder}: neither {WEIGHTS} nor {INDEX} is there")
    from safetensors import safe_open
    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}


def load_stage_tensors(folder: Path, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """The tensors of one stage (``shapes``: its parameter names and shapes), read from the
    checkpoint folder and cast to fp32; nothing else is read. A tied checkpoint (no
    ``lm_head.weight``) gives the head a copy of the embedding.

    Raises:
        HFCheckpointError: a tensor missing or of another shape, naming it.
    """
    from safetensors import safe_open
    where = _weight_files(folder)
    wanted: dict[str, str] = {}
    for name in shapes:
        key = hf_name(name)
        if key not in where and key == "lm_head.weight" and "model.embed_tokens.weight" in where:
            key = "model.embed_tokens.weight"  # tied checkpoint: the head is the embedding
        if key not in where:
            raise HFCheckpointError(f"model.init_from {folder}: the checkpoint has no tensor {key}")
        wanted[name] = key
    out: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[str]] = {}
    for name, key in wanted.items():
        by_file.setdefault(where[key], []).append(name)
    for file, names in by_file.items():
        with safe_open(str(file), framework="pt") as f:
            for name in names:
                t = f.get_tensor(wanted[name])
                if tuple(t.shape) != tuple(shapes[name]):
                    raise HFCheckpointError(f"model.init_from {folder}: tensor {wanted[name]} has shape "
                                            f"{tuple(t.shape)}, the manifest's model needs {tuple(shapes[name])}")
                out[name] = t.to(torch.float32)
    return out


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what tokenizers' ByteLevel uses)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def byte_tokenizer_json() -> str:
    """A ``tokenizer.json`` whose token ids are the raw UTF-8 bytes (0..255), the byte-level data's
    ids: a byte-level BPE with no merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok.to_str()


def _special_tokens(tokenizer_json: str) -> dict[str, tuple[str, int]]:
    """bos/eos and pad of a tokenizer file: the end-of-document token (``<|endoftext|>``, the
    run's tokenizers' id 0, peer/text/tokenizer.py; else the first special token) is both bos and
    eos, ``<|pad|>`` pads. Empty for the byte tokenizer."""
    special = {t["content"]: int(t["id"]) for t in json.loads(tokenizer_json).get("added_tokens", [])
               if t.get("special")}
    out: dict[str, tuple[str, int]] = {}
    eod = "<|endoftext|>" if "<|endoftext|>" in special else next(iter(special), None)
    if eod is not None:
        out["bos_token"] = out["eos_token"] = (eod, special[eod])
    if "<|pad|>" in special:
        out["pad_token"] = ("<|pad|>", special["<|pad|>"])
    return out


def write_hf_folder(out: Path, cfg: LlamaConfig, tensors: Mapping[str, torch.Tensor],
                    tokenizer_file: Path | None = None, metadata: Mapping[str, str] | None = None,
                    seed: int | None = None) -> None:
    """Write a Hugging Face checkpoint folder of the whole model.

    ``tensors`` are the swarm's parameters of every stage (swarm names, global layer indices).
    ``tokenizer_file``: the run's ``tokenizer.json``, copied; None writes the byte tokenizer.
    A ``boundary_subspace`` model is written multiplied out, an ordinary Llama
    (peer/model/subspace.py ``dense_tensors``): that needs the run's ``seed``, which made its
    frozen embedding and subspace.

    Raises:
        ValueError: tensors missing, left over or of another shape than the model ``cfg`` describes;
            a boundary_subspace model without its seed.
    """
    from safetensors.torch import save_file
    if cfg.boundary_subspace:
        if seed is None:
            raise ValueError("a boundary_subspace model's export needs the run's seed (its frozen embedding and "
                             "subspace are made from it)")
        from .subspace import dense_tensors
        tensors = dense_tensors(tensors, seed, cfg.vocab_size, cfg.d_model, cfg.boundary_subspace)
        cfg = dataclasses.replace(cfg, boundary_subspace=0)
    expected = _expected_shapes(cfg)
    names = {hf_name(n) for n in tensors}
    if names != set(expected):
        missing, extra = sorted(set(expected) - names), sorted(names - set(expected))
        raise ValueError(f"the stages' tensors are not the model's: missing {missing[:3]}, unexpected {extra[:3]}")
    for name, t in tensors.items():
        if tuple(t.shape) != expected[hf_name(name)]:
            raise ValueError(f"tensor {name} has shape {tuple(t.shape)}, the manifest's model has "
                             f"{expected[hf_name(name)]}: is it this run's manifest?")
    out.mkdir(parents=True, exist_ok=True)
    text = tokenizer_file.read_text() if tokenizer_file is not None else byte_tokenizer_json()
    special = _special_tokens(text)
    ids = {name: token_id for name, (_, token_id) in special.items()}
    (out / "tokenizer.json").write_text(text)
    tok_config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": cfg.seq_len,
                  "clean_up_tokenization_spaces": False, **{name: tok for name, (tok, _) in special.items()}}
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    config = hf_config(cfg, bos_token_id=ids.get("bos_token"), eos_token_id=ids.get("eos_token"))
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"_from_model_config": True, "bos_token_id": ids.get("bos_token"),
                  "eos_token_id": ids.get("eos_token"), "pad_token_id": ids.get("pad_token"),
                  "max_length": cfg.seq_len}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    weights = {hf_name(n): t.detach().to("cpu", torch.float32).contiguous() for n, t in tensors.items()}
    save_file(weights, str(out / WEIGHTS), metadata={"format": "pt", **(metadata or {})})
    # a stale index from an earlier sharded export would shadow the new single file
    (out / INDEX).unlink(missing_ok=True)


def _expected_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Hugging Face name -> shape of every tensor of the whole model (built on the meta device: no memory)."""
    with torch.device("meta"):
        whole = LlamaStage(cfg, 0, 1, first_layer=0, n_layers=cfg.n_layers)
    return {hf_name(n): tuple(p.shape) for n, p in whole.named_parameters()}
