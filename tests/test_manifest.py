"""The run manifest: loading, defaults, every refusal naming its field, hash stability, TOML round trips."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest

from swarmgrad.peer.manifest import (
    InnerOptConfig,
    Manifest,
    ManifestError,
    ModelConfig,
    TimeoutsConfig,
    dumps,
    from_dict,
    load,
    loads,
)

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tiny-gpt.toml"

PINNED = {
    "run_id": "pinned-run",
    "seed": 7,
    "model": {"d_model": 64, "n_layers": 2, "n_heads": 2, "seq_len": 32},
    "stages": {"count": 2},
    "rounds": {"inner_steps": 10, "round_seconds": 0.0},
}
# Manifest.hash of PINNED. Every peer of a run compares this value, so a change to the hashing
# (or to a default) splits old and new peers into different runs: update it only on purpose.
# changed deliberately when [schedule], robust averaging, backups, timeouts.rebalance_check/move, timeouts.commit
# and rounds.overlap, averaging.reducer_feedback, averaging.gather_up_to, averaging.feedback_decay were added,
# and timeouts.rebalance_check's default went from 30 s to 15 s, and pipeline.lookahead and
# averaging.backup_link_share were added, and timeouts.between_rounds, and data.evaluators, and
# inner.microbatch_sizes, and rounds.overlap_steps, and timeouts.join_hold, and data.text_field,
# data.tokenizer_sha256, data.shard_mb (data.tokenizer and data.base_dir are not hashed), the llama
# kind's model fields, and data.shards, data.lease_seconds, data.lease_settle, and timeouts.tokenizer,
# and model.boundary_subspace, and pipeline.routing, pipeline.forward_first, and
# pipeline.stale_correction and pipeline.stale_correction_scale, and averaging.verify
PINNED_HASH = "7f5040529bbab9bb90a326cf23b45957"


def with_section(section: str, **values: Any) -> dict[str, Any]:
    """A minimal valid raw manifest with `values` set in `section`."""
    return {"run_id": "t", section: values}


# --------------------------------------------------------------------------- loading, defaults


def test_example_loads_with_its_values() -> None:
    m = load(EXAMPLE)
    assert m.run_id == "tiny-gpt"
    assert m.seed == 0
    assert (m.model.kind, m.model.d_model, m.model.n_layers, m.model.n_heads, m.model.seq_len) == ("gpt", 128, 4, 4, 128)
    assert m.stages.count == 2 and m.layers_per_stage == (2, 2)
    assert m.inner.lr == 2e-3 and m.inner.betas == (0.9, 0.95) and m.inner.microbatch_size == 16
    assert m.outer == dataclasses.replace(m.outer, lr=0.7, momentum=0.9, nesterov=True)
    assert m.rounds.round_seconds == 20.0 and m.rounds.inner_steps == 0
    assert m.data.eval_every == 3
    # values not in the file keep their defaults
    assert m.timeouts.heartbeat == TimeoutsConfig().heartbeat
    assert m.pipeline.max_retries == 5


def test_load_accepts_str_path_and_equals_loads() -> None:
    assert load(str(EXAMPLE)) == loads(EXAMPLE.read_text())


def test_defaults_for_minimal_manifest() -> None:
    m = loads('run_id = "x"')
    assert m == Manifest(run_id="x")
    assert m.seed == 0
    assert m.model == ModelConfig()
    assert m.inner == InnerOptConfig()
    assert m.model.vocab_size == 256 and m.model.params == {}
    assert m.stages.layers == () and m.layers_per_stage == (2, 2)
    assert m.rounds.round_seconds == 30.0 and m.rounds.inner_steps == 0
    assert m.averaging.codec == "int8" and m.averaging.error_feedback and m.data.source == "stdlib"
    assert m.hash == Manifest(run_id="x").hash


def test_layers_per_stage_uneven_split_puts_extra_blocks_first() -> None:
    m = from_dict({"run_id": "t", "model": {"n_layers": 5}, "stages": {"count": 3}})
    assert m.layers_per_stage == (2, 2, 1)
    m = from_dict({"run_id": "t", "model": {"n_layers": 5}, "stages": {"count": 2, "layers": [1, 4]}})
    assert m.layers_per_stage == (1, 4)


def test_int_is_accepted_for_a_float_field() -> None:
    m = loads('run_id = "t"\n[inner]\nlr = 1\n')
    assert m.inner.lr == 1.0 and isinstance(m.inner.lr, float)


# --------------------------------------------------------------------------- refusals

INVALID: list[tuple[str, dict[str, Any], list[str]]] = [
    ("lr negative", with_section("inner", lr=-1.0), ["inner.lr", "> 0"]),
    ("lr zero", with_section("inner", lr=0), ["inner.lr"]),
    ("lr string", with_section("inner", lr="0.1"), ["inner.lr", "number"]),
    ("lr bool", with_section("inner", lr=True), ["inner.lr", "number"]),
    ("d_model bool", with_section("model", d_model=True), ["model.d_model", "integer"]),
    ("n_layers float", with_section("model", n_layers=4.0), ["model.n_layers", "integer"]),
    ("n_heads string", with_section("model", n_heads="4"), ["model.n_heads", "integer"]),
    ("nesterov int", with_section("outer", nesterov=1), ["outer.nesterov", "true or false"]),
    ("codec not a string", with_section("averaging", codec=8), ["averaging.codec", "string"]),
    ("betas not a list", with_section("inner", betas=0.9), ["inner.betas", "list"]),
    ("betas wrong length", with_section("inner", betas=[0.9]), ["inner.betas"]),
    ("beta >= 1", with_section("inner", betas=[0.9, 1.0]), ["inner.betas"]),
    ("params not a table", with_section("model", params=[1]), ["model.params", "table"]),
    ("section not a table", {"run_id": "t", "inner": 3}, ["inner", "table"]),
    ("d_model % n_heads", {"run_id": "t", "model": {"d_model": 130, "n_heads": 4}},
     ["model.d_model", "model.n_heads"]),
    ("vocab not 256", with_section("model", vocab_size=512), ["model.vocab_size"]),
    ("bad kind", with_section("model", kind="rnn"), ["model.kind"]),
    ("entry_point with gpt", with_section("model", entry_point="a.b:c"), ["model.entry_point"]),
    ("bad entry_point", with_section("model", kind="entry_point", entry_point="not a path"),
     ["model.entry_point"]),
    ("layers wrong length", {"run_id": "t", "model": {"n_layers": 4}, "stages": {"count": 2, "layers": [1, 1, 2]}},
     ["stages.layers", "stages.count"]),
    ("layers wrong sum", {"run_id": "t", "model": {"n_layers": 4}, "stages": {"count": 2, "layers": [1, 2]}},
     ["stages.layers", "model.n_layers"]),
    ("layers entry zero", {"run_id": "t", "model": {"n_layers": 4}, "stages": {"count": 2, "layers": [0, 4]}},
     ["stages.layers"]),
    ("count > n_layers", {"run_id": "t", "model": {"n_layers": 4}, "stages": {"count": 5}},
     ["stages.count", "model.n_layers"]),
    ("count zero", with_section("stages", count=0), ["stages.count"]),
    ("rounds both 0", with_section("rounds", inner_steps=0, round_seconds=0.0), ["rounds", "inner_steps"]),
    ("rounds negative", with_section("rounds", max_rounds=-1), ["rounds"]),
    ("overlap_steps negative", with_section("rounds", overlap=True, overlap_steps=-1), ["rounds", "overlap_steps"]),
    ("overlap_steps without overlap", with_section("rounds", overlap_steps=1), ["rounds.overlap_steps", "rounds.overlap"]),
    ("join_hold negative", with_section("timeouts", join_hold=-1.0), ["timeouts.join_hold", "≥ 0"]),
    ("join_hold NaN", with_section("timeouts", join_hold=float("nan")), ["timeouts.join_hold"]),
    ("momentum 1", with_section("outer", momentum=1.0), ["outer.momentum"]),
    ("unknown field", with_section("inner", foo=1), ["inner.foo", "not a known field"]),
    ("unknown section", {"run_id": "t", "optimizer": {"lr": 1.0}}, ["optimizer", "not a known field or section"]),
    ("unknown top-level key", {"run_id": "t", "sed": 1}, ["sed"]),
    ("run_id with space", {"run_id": "my run"}, ["run_id"]),
    ("run_id empty", {"run_id": ""}, ["run_id"]),
    ("run_id leading dash", {"run_id": "-x"}, ["run_id"]),
    ("run_id too long", {"run_id": "a" * 65}, ["run_id"]),
    ("run_id not a string", {"run_id": 5}, ["run_id"]),
    ("run_id missing", {"seed": 1}, ["run_id", "required"]),
    ("seed bool", {"run_id": "t", "seed": True}, ["seed", "integer"]),
    ("files without paths", with_section("data", source="files"), ["data.paths", "data.source"]),
    ("bad data.source", with_section("data", source="web"), ["data.source"]),
    ("val_fraction 1", with_section("data", val_fraction=1.0), ["data.val_fraction"]),
    ("unknown codec", with_section("averaging", codec="zip"), ["averaging.codec", "not a valid codec"]),
    ("bad codec params", with_section("averaging", codec="topk:fraction"), ["averaging.codec"]),
    ("bad codec value", with_section("averaging", codec="int8:block_size=-3"), ["averaging.codec"]),
    ("bad activation codec", with_section("pipeline", activation_codec=""), ["pipeline.activation_codec"]),
    ("bad gradient codec", with_section("pipeline", gradient_codec="nope"), ["pipeline.gradient_codec"]),
    ("max_in_flight 0", with_section("pipeline", max_in_flight=0), ["pipeline.max_in_flight"]),
    ("unknown routing", with_section("pipeline", routing="fastest"), ["pipeline.routing", "measured, announced"]),
    ("heartbeat == ttl", with_section("timeouts", heartbeat=15.0, announce_ttl=15.0),
     ["timeouts.heartbeat", "timeouts.announce_ttl"]),
    ("heartbeat > ttl", with_section("timeouts", heartbeat=20.0), ["timeouts.heartbeat"]),
    ("timeout zero", with_section("timeouts", dht=0.0), ["timeouts.dht"]),
    ("min_microbatch > microbatch", with_section("timeouts", min_microbatch=40.0), ["timeouts.min_microbatch"]),
]


@pytest.mark.parametrize("raw, needles", [pytest.param(r, n, id=i) for i, r, n in INVALID])
def test_invalid_manifest_names_the_field(raw: dict[str, Any], needles: list[str]) -> None:
    with pytest.raises(ManifestError) as info:
        from_dict(raw)
    message = str(info.value)
    assert message.startswith(f"manifest: {needles[0]}"), message
    for needle in needles:
        assert needle in message, message


def test_manifest_error_is_a_value_error() -> None:
    assert issubclass(ManifestError, ValueError)


def test_invalid_toml_text() -> None:
    with pytest.raises(ManifestError, match="not valid TOML"):
        loads('run_id = "t"\n[inner\nlr = 1\n')


def test_invalid_toml_file_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text('run_id = "t"\nlr = = 2\n')
    with pytest.raises(ManifestError) as info:
        load(path)
    assert "not valid TOML" in str(info.value) and str(path) in str(info.value)


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.toml"
    with pytest.raises(ManifestError) as info:
        load(path)
    assert "does not exist" in str(info.value) and str(path) in str(info.value)


def test_loads_reports_field_errors_too() -> None:
    with pytest.raises(ManifestError, match=r"^manifest: inner\.foo "):
        loads('run_id = "t"\n[inner]\nfoo = 1\n')


# --------------------------------------------------------------------------- hash

TOML_A = """
run_id = "h"
seed = 3

[model]
d_model = 64
n_layers = 2
n_heads = 2

[inner]
lr = 2e-3
betas = [0.9, 0.95]

[timeouts]
heartbeat = 2
announce_ttl = 10.0
"""

TOML_B = """# the same run: other order, spelling and layout
seed = 3
run_id = "h"   # top-level keys must come before the first table in TOML
model = { n_heads = 2, d_model = 64, n_layers = 2 }

[timeouts]
announce_ttl = 10
heartbeat   = 2.0
[inner]
betas=[ 0.9 , 0.95 ]
lr=0.002
"""


def test_hash_ignores_key_order_and_formatting() -> None:
    a, b = loads(TOML_A), loads(TOML_B)
    assert a == b
    assert a.hash == b.hash


def test_hash_is_hex_and_pinned() -> None:
    m = from_dict(PINNED)
    assert re.fullmatch(r"[0-9a-f]{32}", m.hash)
    assert m.hash == m.hash == from_dict(dict(reversed(list(PINNED.items())))).hash
    assert m.hash == PINNED_HASH


LOCAL_DATA_FIELDS = ("tokenizer", "base_dir")
"""Where this machine keeps the files: neither the hash nor equality sees them (test_text_manifest.py)."""


def _changes(section: str, f: dataclasses.Field, current: Any) -> list[dict[str, Any]]:
    """Candidate valid edits of one field, as `replace` keyword arguments (first valid one is used)."""
    key = f"{section}.{f.name}"
    special: dict[str, list[dict[str, Any]]] = {
        "model.kind": [{"kind": "entry_point", "entry_point": "pkg.mod:make"}],
        "model.vocab_size": [{"kind": "entry_point", "entry_point": "pkg.mod:make", "vocab_size": 300}],
        "model.entry_point": [{"kind": "entry_point", "entry_point": "other.mod:make"}],
        "model.params": [{"params": {"width": 3}}],
        "model.dtype": [{"dtype": "bfloat16"}],
        "stages.layers": [{"layers": [1, 3]}],
        "inner.betas": [{"betas": [0.8, 0.9]}],
        "inner.microbatch_sizes": [{"microbatch_sizes": [1] * k} for k in range(1, 33)],  # one has the right length
        "data.source": [{"source": "files", "paths": ["a.txt"]}],
        "data.paths": [{"source": "files", "paths": ["a.txt", "b.txt"]}],  # paths alone: only with a source
        "averaging.codec": [{"codec": "fp16"}],
        "pipeline.activation_codec": [{"activation_codec": "bf16"}],
        "pipeline.gradient_codec": [{"gradient_codec": "bf16"}],
        "pipeline.routing": [{"routing": "measured"}],
        "pipeline.stale_correction": [{"lookahead": True, "stale_correction": "predict"}],
        "schedule.kind": [{"kind": "cosine", "total_samples": 1000}],
        "schedule.min_lr_ratio": [{"min_lr_ratio": 0.5}],
        "averaging.robust_min_members": [{"robust_min_members": 4}],
        "data.max_bytes": [{"max_bytes": 100_000}],
        "data.text_field": [{"text_field": "content"}],
        "data.tokenizer_sha256": [{"tokenizer": "t.json", "tokenizer_sha256": "0" * 64}],
        "averaging.backup_every": [{"backup_every": 2}],
        "averaging.gather_up_to": [{"gather_up_to": 2}],
        "averaging.feedback_decay": [{"feedback_decay": 0.95}],
        "averaging.backup_link_share": [{"backup_link_share": 0.5}],
        "rounds.overlap_steps": [{"overlap": True, "overlap_steps": 1}],
        "model.n_kv_heads": [{"kind": "llama", "n_kv_heads": 2}],
        "model.ffn_hidden": [{"kind": "llama", "ffn_hidden": 64}],
        "model.rope_theta": [{"kind": "llama", "rope_theta": 20000.0}],
        "model.norm_eps": [{"kind": "llama", "norm_eps": 1e-6}],
        "model.init_from": [{"kind": "llama", "init_from": "checkpoint"}],
        "model.boundary_subspace": [{"kind": "llama", "boundary_subspace": 8}],
    }
    if key == "model.tie_embeddings":  # needs the embedding and the head on one stage
        return [{"model": {"kind": "llama", "tie_embeddings": True}, "stages": {"count": 1}}]
    if key in special:
        return [{section: c} for c in special[key]]
    if isinstance(current, bool):
        values: list[Any] = [not current]
    elif isinstance(current, int):
        values = [current + 1, current * 2, current - 1]
    elif isinstance(current, float):
        values = [current * 2, current / 2, current + 0.01]
    else:
        raise AssertionError(f"no candidate edits for {key} ({current!r})")
    return [{section: {f.name: v}} for v in values]


def _all_field_edits(base: Manifest) -> list[tuple[str, dict[str, Any]]]:
    edits = [("run_id", {"run_id": "other"}), ("seed", {"seed": base.seed + 1})]
    for section in ("model", "stages", "inner", "outer", "schedule", "rounds", "averaging", "pipeline", "data", "timeouts"):
        cfg = getattr(base, section)
        for f in dataclasses.fields(cfg):
            if section == "data" and f.name in LOCAL_DATA_FIELDS:
                continue
            for change in _changes(section, f, getattr(cfg, f.name)):
                try:
                    base.replace(**change)
                except ManifestError:
                    continue
                edits.append((f"{section}.{f.name}", change))
                break
            else:
                raise AssertionError(f"no valid edit found for {section}.{f.name}")
    return edits


def test_every_field_changes_the_hash() -> None:
    base = load(EXAMPLE)
    edits = _all_field_edits(base)
    n_fields = 2 + sum(len(dataclasses.fields(getattr(base, s))) for s in
                       ("model", "stages", "inner", "outer", "schedule", "rounds", "averaging", "pipeline", "data", "timeouts")) \
        - len(LOCAL_DATA_FIELDS)
    assert len(edits) == n_fields
    hashes = {base.hash}
    for name, change in edits:
        changed = base.replace(**change)
        assert changed != base, name
        assert changed.hash != base.hash, name
        hashes.add(changed.hash)
    # distinct edits give distinct hashes (except edits that land on the same manifest)
    assert len(hashes) >= len(edits)


def test_hash_distinguishes_param_values_and_nesting() -> None:
    base = from_dict({"run_id": "t", "model": {"params": {"a": 1, "b": [1, 2]}}})
    assert base.hash != base.replace(model={"params": {"a": 1, "b": [2, 1]}}).hash
    assert base.hash != base.replace(model={"params": {"a": "1", "b": [1, 2]}}).hash
    same = from_dict({"run_id": "t", "model": {"params": {"b": [1, 2], "a": 1}}})
    assert same.hash == base.hash


# --------------------------------------------------------------------------- dumps / replace


def test_dumps_round_trips_the_example() -> None:
    m = load(EXAMPLE)
    text = dumps(m)
    back = loads(text)
    assert back == m
    assert back.hash == m.hash
    assert dumps(back) == text


def test_dumps_round_trips_params_and_layers() -> None:
    m = from_dict({
        "run_id": "rt.1_x",
        "seed": 12,
        "model": {"n_layers": 6, "params": {"width": 48, "name": "a \"quoted\" name", "ratio": 0.25,
                                             "flags": [True, False], "nested": {"k": 1}}},
        "stages": {"count": 3, "layers": [1, 3, 2]},
        "inner": {"lr": 3.5e-4, "betas": [0.5, 0.999]},
        "averaging": {"codec": "topk:fraction=0.01,values=fp16", "error_feedback": True},
        "data": {"source": "files", "paths": ["/data/a.txt", "/data/*.py"]},
        "rounds": {"inner_steps": 50, "round_seconds": 0.0, "max_rounds": 4},
    })
    back = loads(dumps(m))
    assert back == m
    assert back.hash == m.hash
    assert back.stages.layers == (1, 3, 2)
    assert back.model.params["nested"] == {"k": 1}
    assert back.model.params["name"] == 'a "quoted" name'


def test_replace_changes_only_the_named_fields() -> None:
    m = load(EXAMPLE)
    r = m.replace(rounds={"max_rounds": 3})
    assert r.rounds.max_rounds == 3
    assert r.rounds.round_seconds == m.rounds.round_seconds
    assert r.model == m.model and r.inner == m.inner
    assert m.rounds.max_rounds == 0  # the original is untouched
    assert m.replace(seed=9).seed == 9
    assert m.replace() == m


def test_replace_validates() -> None:
    m = load(EXAMPLE)
    with pytest.raises(ManifestError, match=r"^manifest: inner\.lr must be > 0"):
        m.replace(inner={"lr": -1.0})
    with pytest.raises(ManifestError, match=r"^manifest: stages\.count"):
        m.replace(stages={"count": 9})
    with pytest.raises(ManifestError, match=r"^manifest: inner\.bogus"):
        m.replace(inner={"bogus": 1})
    with pytest.raises(ManifestError, match=r"^manifest: run_id"):
        m.replace(run_id="has space")


@pytest.mark.parametrize("section, values, field", [
    ("pipeline", {"max_message_mb": float("inf")}, "pipeline.max_message_mb"),
    ("pipeline", {"max_message_mb": 0.001}, "pipeline.max_message_mb"),
    ("pipeline", {"lookahead": True, "stale_correction": "nag"}, "pipeline.stale_correction"),
    ("pipeline", {"stale_correction": "predict"}, "pipeline.stale_correction"),  # without lookahead
    ("pipeline", {"lookahead": True, "stale_correction": "predict", "stale_correction_scale": -1.0},
     "pipeline.stale_correction_scale"),
    ("pipeline", {"lookahead": True, "stale_correction_scale": float("nan")}, "pipeline.stale_correction_scale"),
    ("outer", {"lr": float("inf")}, "outer.lr"),
    ("inner", {"lr": float("nan")}, "inner.lr"),
    ("data", {"max_bytes": 50}, "data.max_bytes"),
    ("data", {"evaluators": -1}, "data.evaluators"),
    ("averaging", {"robust_min_members": 2}, "averaging.robust_min_members"),
    ("averaging", {"max_weight_ratio": 0.5}, "averaging.max_weight_ratio"),
    ("averaging", {"backup_link_share": 0.0}, "averaging.backup_link_share"),
    ("averaging", {"backup_link_share": 1.5}, "averaging.backup_link_share"),
    ("timeouts", {"announce_ttl": 200.0}, "timeouts.announce_ttl"),
    ("inner", {"microbatch_sizes": [2, 8, 2]}, "inner.microbatch_sizes"),  # 3 entries, 4 per step
    ("inner", {"microbatch_sizes": [2, 9, 8, 2]}, "inner.microbatch_sizes"),  # above microbatch_size 8
    ("inner", {"microbatch_sizes": [2, 0, 8, 2]}, "inner.microbatch_sizes"),
    ("inner", {"microbatch_sizes": [2, 4.5, 8, 2]}, "inner.microbatch_sizes"),
])
def test_absurd_values_are_refused_naming_the_field(section: str, values: dict, field: str) -> None:
    with pytest.raises(ManifestError, match=re.escape(field)):
        from_dict({"run_id": "x", section: values})


def test_tapered_step_sizes() -> None:
    m = from_dict({"run_id": "x", "inner": {"microbatch_size": 8, "microbatches_per_step": 4,
                                            "microbatch_sizes": [2, 8, 8, 4]}})
    assert m.inner.step_sizes == (2, 8, 8, 4) and m.inner.step_samples == 22
    plain = from_dict({"run_id": "x", "inner": {"microbatch_size": 8, "microbatches_per_step": 4}})
    assert plain.inner.step_sizes == (8, 8, 8, 8) and plain.inner.step_samples == 32


def test_params_must_be_plain_values() -> None:
    """A TOML date (or any value JSON cannot hold) in model.params is refused before anything starts."""
    with pytest.raises(ManifestError, match=r"model\.params\.when"):
        loads('run_id = "x"\n[model]\nkind = "entry_point"\nentry_point = "a.b:c"\n'
              '[model.params]\nwhen = 1979-05-27T07:32:00Z\n')
    with pytest.raises(ManifestError, match="finite"):
        from_dict({"run_id": "x", "model": {"kind": "entry_point", "entry_point": "a.b:c",
                                            "params": {"scale": [1.0, float("inf")]}}})


@pytest.mark.parametrize("path", sorted(EXAMPLE.parent.glob("*.toml")), ids=lambda p: p.name)
def test_every_example_manifest_loads(path: Path) -> None:
    m = load(path)  # validated when loaded: a field renamed or a bad codec spec fails here
    assert m.run_id and len(m.hash) == 32
