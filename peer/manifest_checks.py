"""Cross-field checks of a loaded manifest: each names the field and the fix.

Split from peer/manifest.py (the dataclasses, loading and TOML), which calls `check` through
`manifest.validate` after every load, so a Manifest that exists has passed these.
"""
from __future__ import annotations

import dataclasses
import math
import re

from swarmgrad.peer.manifest import PIPELINE_ROUTINGS, STALE_CORRECTIONS, Manifest, _fail

MAX_SHARDS = 65536
"""data.shards at most: a driver's DHT record carries the done shards as a bitmap, 8 KiB at this
many, well inside hivemind's ~16 KiB values (peer/shards/leases.py)."""


def _positive(name: str, value: float) -> None:
    if not value > 0:
        raise _fail(name, f"must be > 0 (got {value})")


def check(m: Manifest) -> None:
    """Cross-field checks; raises ManifestError naming the field and the fix."""
    md = m.model
    if md.kind not in ("gpt", "llama", "entry_point"):
        raise _fail("model.kind", f"must be \"gpt\", \"llama\" or \"entry_point\" (got {md.kind!r})")
    if md.kind == "llama":
        _check_llama(m)
    else:
        for name in _LLAMA_ONLY:
            if getattr(md, name) != getattr(type(md)(), name):
                raise _fail(f"model.{name}", "is only used with model.kind = \"llama\"")
    if md.kind == "gpt":
        if md.entry_point:
            raise _fail("model.entry_point", "is only used with model.kind = \"entry_point\"")
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "seq_len"):
            _positive(f"model.{name}", getattr(md, name))
        if md.vocab_size != 256 and not m.data.tokenizer:
            raise _fail("model.vocab_size", f"must be 256 for the byte-level GPT without data.tokenizer "
                                            f"(got {md.vocab_size})")
        if md.d_model % md.n_heads:
            raise _fail("model.d_model", f"({md.d_model}) must be divisible by model.n_heads ({md.n_heads})")
    elif md.kind == "entry_point" and not re.match(r"^[\w.]+:[\w]+$", md.entry_point):
        raise _fail("model.entry_point", f"must look like \"package.module:function\" (got {md.entry_point!r})")
    if md.dtype not in ("float32", "bfloat16"):
        raise _fail("model.dtype", f"must be \"float32\" or \"bfloat16\" (got {md.dtype!r})")
    st = m.stages
    if st.count < 1:
        raise _fail("stages.count", f"must be >= 1 (got {st.count})")
    if st.layers:
        if len(st.layers) != st.count:
            raise _fail("stages.layers", f"has {len(st.layers)} entries but stages.count is {st.count}")
        if any((not isinstance(n, int)) or n < 1 for n in st.layers):
            raise _fail("stages.layers", f"entries must be integers >= 1 (got {list(st.layers)})")
        if md.kind in ("gpt", "llama") and sum(st.layers) != md.n_layers:
            raise _fail("stages.layers", f"sums to {sum(st.layers)} but model.n_layers is {md.n_layers}")
    elif md.kind in ("gpt", "llama") and st.count > md.n_layers:
        raise _fail("stages.count", f"({st.count}) cannot exceed model.n_layers ({md.n_layers})")
    inn = m.inner
    _positive("inner.lr", inn.lr)
    if len(inn.betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in inn.betas):
        raise _fail("inner.betas", f"must be two numbers in [0, 1) (got {list(inn.betas)})")
    if inn.weight_decay < 0:
        raise _fail("inner.weight_decay", f"must be >= 0 (got {inn.weight_decay})")
    if inn.grad_clip < 0:
        raise _fail("inner.grad_clip", f"must be >= 0, 0 disables clipping (got {inn.grad_clip})")
    _positive("inner.microbatch_size", inn.microbatch_size)
    _positive("inner.microbatches_per_step", inn.microbatches_per_step)
    if inn.microbatch_sizes:
        sizes = list(inn.microbatch_sizes)
        if len(sizes) != inn.microbatches_per_step:
            raise _fail("inner.microbatch_sizes", f"has {len(sizes)} entries but inner.microbatches_per_step is "
                        f"{inn.microbatches_per_step} (one size per microbatch of a step)")
        if any(isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= inn.microbatch_size for n in sizes):
            raise _fail("inner.microbatch_sizes", f"entries must be integers in 1..inner.microbatch_size "
                        f"({inn.microbatch_size}) (got {sizes})")
    if inn.swarm_second_moment and inn.microbatches_per_step < 2:
        raise _fail("inner.swarm_second_moment", "measures gradient noise from the spread between a step's "
                    f"microbatches: needs inner.microbatches_per_step >= 2 (got {inn.microbatches_per_step})")
    _positive("outer.lr", m.outer.lr)
    if not 0 <= m.outer.momentum < 1:
        raise _fail("outer.momentum", f"must be in [0, 1) (got {m.outer.momentum})")
    sc = m.schedule
    if sc.kind not in ("constant", "cosine", "linear"):
        raise _fail("schedule.kind", f"must be \"constant\", \"cosine\" or \"linear\" (got {sc.kind!r})")
    if sc.warmup_samples < 0 or sc.total_samples < 0:
        raise _fail("schedule", "warmup_samples and total_samples must be >= 0")
    if sc.kind != "constant" and sc.total_samples <= sc.warmup_samples:
        raise _fail("schedule.total_samples", f"({sc.total_samples}) must exceed schedule.warmup_samples "
                                              f"({sc.warmup_samples}) for a {sc.kind} decay")
    if not 0 <= sc.min_lr_ratio <= 1:
        raise _fail("schedule.min_lr_ratio", f"must be in [0, 1] (got {sc.min_lr_ratio})")
    r = m.rounds
    if r.inner_steps < 0 or r.round_seconds < 0 or r.max_rounds < 0 or r.overlap_steps < 0:
        raise _fail("rounds", "inner_steps, round_seconds, max_rounds and overlap_steps must be >= 0")
    if r.overlap_steps and not r.overlap:
        raise _fail("rounds.overlap_steps", "bounds overlapped rounds: it needs rounds.overlap = true")
    if r.inner_steps == 0 and r.round_seconds == 0:
        raise _fail("rounds", "needs inner_steps > 0 or round_seconds > 0 (or both) to know when a round ends")
    _check_codec("averaging.codec", m.averaging.codec)
    _check_codec("pipeline.activation_codec", m.pipeline.activation_codec)
    _check_codec("pipeline.gradient_codec", m.pipeline.gradient_codec)
    if m.averaging.small_tensor_threshold < 0:
        raise _fail("averaging.small_tensor_threshold", "must be >= 0")
    if not 0.0 < m.averaging.feedback_decay <= 1.0:
        raise _fail("averaging.feedback_decay", f"must be in (0, 1], 1 is plain error feedback "
                                                f"(got {m.averaging.feedback_decay})")
    if m.averaging.gather_up_to < 0 or m.averaging.gather_up_to == 1:
        raise _fail("averaging.gather_up_to", f"must be 0 (off) or >= 2, the largest group that gathers "
                                              f"(got {m.averaging.gather_up_to})")
    if m.averaging.robust_min_members < 0 or m.averaging.robust_min_members in (1, 2):
        raise _fail("averaging.robust_min_members", f"must be 0 (off) or >= 3: with fewer members no member can be "
                                                    f"told from the others (got {m.averaging.robust_min_members})")
    if m.averaging.backup_every < 0:
        raise _fail("averaging.backup_every", f"must be >= 0, 0 disables backups (got {m.averaging.backup_every})")
    if not 0.0 < m.averaging.backup_link_share <= 1.0:
        raise _fail("averaging.backup_link_share", f"must be in (0, 1], 1 does not pace backups "
                                                   f"(got {m.averaging.backup_link_share})")
    if m.averaging.verify and m.averaging.reducer_feedback:
        raise _fail("averaging.verify", "cannot be checked with averaging.reducer_feedback: the reducer's mean then "
                                        "carries its own error-feedback residual, which no other member can recompute")
    if m.averaging.verify and _stochastic(m.averaging.codec):
        raise _fail("averaging.verify", f"needs a deterministic reduce codec: {m.averaging.codec!r} rounds "
                                        f"stochastically, so no member could recompute a reducer's mean")
    if not 1 <= m.averaging.max_weight_ratio < math.inf:
        raise _fail("averaging.max_weight_ratio", f"must be a finite number >= 1 (got {m.averaging.max_weight_ratio})")
    _positive("pipeline.max_in_flight", m.pipeline.max_in_flight)
    _positive("pipeline.max_retries", m.pipeline.max_retries)
    if m.pipeline.routing not in PIPELINE_ROUTINGS:
        raise _fail("pipeline.routing", f"must be one of {', '.join(PIPELINE_ROUTINGS)} (got {m.pipeline.routing!r})")
    _check_stale_correction(m)
    if not 1 <= m.pipeline.max_message_mb <= 4096:
        raise _fail("pipeline.max_message_mb", f"must be in [1, 4096] MiB (got {m.pipeline.max_message_mb}): "
                                               "smaller cannot carry a microbatch, larger is a memory hazard")
    d = m.data
    _check_data_source(m)
    if not 0 < d.val_fraction < 1:
        raise _fail("data.val_fraction", f"must be in (0, 1) (got {d.val_fraction})")
    if d.max_bytes < 0 or d.eval_every < 0:
        raise _fail("data", "max_bytes and eval_every must be >= 0")
    if d.evaluators < 0:
        raise _fail("data.evaluators", f"must be >= 0 (0: every driver evaluates; got {d.evaluators})")
    if md.kind in ("gpt", "llama") and 0 < d.max_bytes < md.seq_len + 1:
        raise _fail("data.max_bytes", f"({d.max_bytes}) must be 0 (no cap) or at least model.seq_len + 1 "
                                      f"({md.seq_len + 1}): one training window needs that many bytes")
    _positive("data.eval_batches", d.eval_batches)
    if not 0 <= d.shards <= MAX_SHARDS:
        raise _fail("data.shards", f"must be 0 (no leases) or 1 to {MAX_SHARDS} (got {d.shards}): a driver's DHT "
                                   "record carries the done shards as a bitmap")
    if not d.lease_seconds >= 2 * m.timeouts.dht:
        raise _fail("data.lease_seconds", f"({d.lease_seconds}) must be at least 2 x timeouts.dht "
                                          f"({2 * m.timeouts.dht}): a renewal reads and writes the DHT, each within "
                                          "timeouts.dht, every third of a lease")
    if not 0 <= d.lease_settle < d.lease_seconds / 3:
        raise _fail("data.lease_settle", f"must be >= 0 and under a third of data.lease_seconds "
                                         f"(got {d.lease_settle})")
    for f in dataclasses.fields(m.timeouts):
        if f.name not in ("between_rounds", "join_hold"):  # 0 turns these holds off
            _positive(f"timeouts.{f.name}", getattr(m.timeouts, f.name))
    for name in ("between_rounds", "join_hold"):
        if not getattr(m.timeouts, name) >= 0:  # also refuses NaN
            raise _fail(f"timeouts.{name}", f"must be ≥ 0 (got {getattr(m.timeouts, name)})")
    if m.timeouts.min_microbatch > m.timeouts.microbatch:
        raise _fail("timeouts.min_microbatch", "must not exceed timeouts.microbatch")
    if m.timeouts.announce_ttl * 4 > 600:
        # round registrations live 4 x announce_ttl, and signed DHT records may not live longer than
        # 600 s (peer/record_signing.MAX_RECORD_TTL): a longer TTL would be clamped silently
        raise _fail("timeouts.announce_ttl", f"({m.timeouts.announce_ttl}) must be at most 150 s: DHT records "
                                             "are capped at 600 s and registrations live 4 x announce_ttl")
    if m.timeouts.heartbeat >= m.timeouts.announce_ttl:
        raise _fail("timeouts.heartbeat", "must be shorter than timeouts.announce_ttl, or records expire between refreshes")


def _check_data_source(m: Manifest) -> None:
    d = m.data
    sources = ("stdlib", "files", "jsonl", "parquet", "hf-disk")
    if d.source not in sources:
        raise _fail("data.source", f"must be one of {', '.join(repr(s) for s in sources)} (got {d.source!r})")
    if d.source != "stdlib" and not d.paths:
        raise _fail("data.paths", f"must list files, folders or globs when data.source = \"{d.source}\"")
    if d.source == "stdlib" and d.paths:
        raise _fail("data.paths", "is only used with a source other than \"stdlib\"; remove it or set data.source")
    if not d.text_field:
        raise _fail("data.text_field", "must name the JSON key or column that holds the text (default \"text\")")
    if not d.shard_mb > 0:
        raise _fail("data.shard_mb", f"must be > 0 (got {d.shard_mb})")
    if d.tokenizer and not re.fullmatch(r"[0-9a-f]{64}", d.tokenizer_sha256):
        raise _fail("data.tokenizer_sha256", "must pin the tokenizer file: the 64 hex digits `swarmgrad tokenizer "
                                             f"train` printed, or `sha256sum {d.tokenizer}` (got {d.tokenizer_sha256!r})")
    if d.tokenizer_sha256 and not d.tokenizer:
        raise _fail("data.tokenizer_sha256", "pins a tokenizer but data.tokenizer names none")
    if d.max_bytes and (d.tokenizer or d.source in ("jsonl", "parquet", "hf-disk")):
        raise _fail("data.max_bytes", "caps the byte-level corpus only; a tokenized or row source streams "
                                      "its shards (choose the files with data.paths)")


_LLAMA_ONLY = ("n_kv_heads", "ffn_hidden", "rope_theta", "norm_eps", "tie_embeddings", "init_from",
               "boundary_subspace")


def _check_llama(m: Manifest) -> None:
    md = m.model
    if md.entry_point:
        raise _fail("model.entry_point", "is only used with model.kind = \"entry_point\"")
    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "seq_len"):
        _positive(f"model.{name}", getattr(md, name))
    for name in ("n_kv_heads", "ffn_hidden"):
        if getattr(md, name) < 0:
            raise _fail(f"model.{name}", f"must be >= 0, 0 is the default (got {getattr(md, name)})")
    _positive("model.rope_theta", md.rope_theta)
    _positive("model.norm_eps", md.norm_eps)
    if md.d_model % md.n_heads:
        raise _fail("model.d_model", f"({md.d_model}) must be divisible by model.n_heads ({md.n_heads})")
    if (md.d_model // md.n_heads) % 2:
        raise _fail("model.n_heads", f"gives a head dimension d_model / n_heads = {md.d_model // md.n_heads}; "
                                     "rotary embeddings need it even")
    kv = md.n_kv_heads or md.n_heads
    if md.n_heads % kv:
        raise _fail("model.n_kv_heads", f"({kv}) must divide model.n_heads ({md.n_heads}): each key/value head "
                                        "serves a whole group of query heads")
    if md.tie_embeddings and m.stages.count > 1:
        raise _fail("model.tie_embeddings", f"needs the embedding (stage 0) and the head (stage "
                                            f"{m.stages.count - 1}) on one stage: on two, the one tensor would live "
                                            "on two peers that drift apart between averaging rounds; set "
                                            "stages.count = 1 or tie_embeddings = false")
    _check_boundary_subspace(m)
    # byte-level data feeds ids 0..255; a tokenizer (data.tokenizer, when named) gives its own vocabulary
    if not getattr(m.data, "tokenizer", "") and md.vocab_size < 256:
        raise _fail("model.vocab_size", f"must be >= 256 with byte-level data (got {md.vocab_size})")


def _check_boundary_subspace(m: Manifest) -> None:
    md, k = m.model, m.model.boundary_subspace
    if k == 0:
        return
    if not 0 < k < md.d_model:
        raise _fail("model.boundary_subspace", f"must be 0 (off) or in 1..{md.d_model - 1}, below model.d_model "
                                               f"(got {k})")
    if m.stages.count < 2:
        raise _fail("model.boundary_subspace", "constrains what crosses a stage boundary and a one-stage run has "
                                               "none: set stages.count >= 2 or boundary_subspace = 0")
    if md.tie_embeddings:
        raise _fail("model.boundary_subspace", "with tie_embeddings: the head would reuse an embedding split "
                                               "into a frozen and a subspace part; set tie_embeddings = false")
    if md.init_from:
        raise _fail("model.boundary_subspace", "with model.init_from: a checkpoint's full-rank residual writes "
                                               "have no exact k-dimensional form; start from the seeded "
                                               "initialisation or set boundary_subspace = 0")
    if md.vocab_size > 1 << 24:
        raise _fail("model.boundary_subspace", f"carries token ids in fp32, exact up to 2^24; vocab_size is "
                                               f"{md.vocab_size}")


def _check_stale_correction(m: Manifest) -> None:
    p = m.pipeline
    if p.stale_correction not in STALE_CORRECTIONS:
        raise _fail("pipeline.stale_correction", f"must be one of {', '.join(STALE_CORRECTIONS)} "
                                                 f"(got {p.stale_correction!r})")
    if p.stale_correction != "none" and not p.lookahead:
        raise _fail("pipeline.stale_correction", "corrects the stale gradients of pipeline.lookahead: it needs "
                                                 "pipeline.lookahead = true")
    if not 0.0 <= p.stale_correction_scale < math.inf:
        raise _fail("pipeline.stale_correction_scale", f"must be a finite number >= 0 (got "
                                                       f"{p.stale_correction_scale}): the predicted steps the stash "
                                                       "moves (1: the one step of delay), or λ with delay_comp")


def _check_codec(name: str, spec: str) -> None:
    # Imported lazily: the manifest is loadable (and testable) before the codec library is.
    from swarmgrad.compression import CodecError, parse_codec_spec
    try:
        parse_codec_spec(spec)
    except CodecError as e:
        raise _fail(name, f"is not a valid codec ({e})") from None


def _stochastic(spec: str) -> bool:
    """Whether the reduce codec of the averaging codec `spec` rounds stochastically (a reducer's
    mean is then not a function of the parts alone). Called after _check_codec."""
    from swarmgrad.compression import parse_codec_spec, reduce_codec
    codec = reduce_codec(parse_codec_spec(spec))
    return any(getattr(c, "stochastic", False) for c in (codec, getattr(codec, "small", None),
                                                          getattr(codec, "large", None)))
