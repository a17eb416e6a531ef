"""``rollout.sampling`` and ``rollout.engine``: sections typed by the runtime classes
``SamplingParams`` and ``EngineOptions`` themselves, validated once, with the old flat
``rollout.*`` keys still accepted (one deprecation warning per key naming the new key)."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import pytest
import yaml

from megatron_grpo.config import ConfigError, rename_keys, to_dict
from megatron_grpo.rollout import EngineOptions, SamplingParams
from megatron_grpo.train.config import RENAMED_KEYS, TrainConfig, load_train_config

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
RECIPE = RECIPES / "tiny.yaml"


def _recipe(tmp_path: Path, rollout: dict) -> Path:
    data = yaml.safe_load(RECIPE.read_text())
    data["rollout"] = {k: v for k, v in data["rollout"].items() if k != "sampling"} | rollout
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _load_quietly(path: Path | None, overrides: list[str] = ()) -> TrainConfig:
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # no deprecated key in use
        return load_train_config(path, list(overrides))


def test_sections_are_the_runtime_classes_and_load_from_yaml(tmp_path):
    sampling = {"temperature": 0.8, "top_p": 0.9, "top_k": 5, "stop_ids": [7], "ignore_eos": True}
    engine = {"kind": "recompute", "kv_cache_gib": 2, "decode_path": "modules"}
    cfg = _load_quietly(_recipe(tmp_path, {"sampling": sampling, "engine": engine}))
    s, e = cfg.rollout.sampling, cfg.rollout.engine
    assert type(s) is SamplingParams and type(e) is EngineOptions
    assert s == SamplingParams(temperature=0.8, top_p=0.9, top_k=5, stop_ids=(7,), ignore_eos=True)
    assert (e.kind, e.kv_cache_gib, e.decode_path) == ("recompute", 2.0, "modules")
    default = TrainConfig().rollout
    assert (default.sampling, default.engine) == (SamplingParams(), EngineOptions())


def test_set_overrides_reach_the_sections():
    sets = ["rollout.sampling.temperature=0.7", "rollout.engine.kind=recompute"]
    cfg = _load_quietly(RECIPE, [*sets, "rollout.engine.cuda_graphs=false"])
    assert cfg.rollout.sampling.temperature == 0.7
    assert (cfg.rollout.engine.kind, cfg.rollout.engine.cuda_graphs) == ("recompute", False)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("rollout.sampling.temprature=1", r"'rollout\.sampling\.temprature'.*'temperature'"),
        ("rollout.engine.kv_cache_gb=1", r"'rollout\.engine\.kv_cache_gb'.*'kv_cache_gib'"),
        ("rollout.sampling.vocab_size=9", r"unknown config key 'rollout\.sampling\.vocab_size'"),
        ("rollout.sampling.temperature=0", r"rollout\.sampling\.temperature must be > 0, got 0"),
        ("rollout.sampling.top_p=1.5", r"rollout\.sampling\.top_p must be in \(0, 1\]"),
        ("rollout.sampling.top_k=x", r"rollout\.sampling\.top_k: expected an integer"),
        ("rollout.engine.kind=vllm", r"rollout\.engine\.kind: 'vllm' is not one of"),
        ("rollout.engine.decode_impl=cuda", r"rollout\.engine\.decode_impl: 'cuda' is not one"),
        ("rollout.engine.kv_cache_fraction=2", r"rollout\.engine\.kv_cache_fraction must be in"),
    ],
)
def test_errors_name_the_recipe_field(override, message):
    with pytest.raises(ConfigError, match=message):
        _load_quietly(RECIPE, [override])


def test_resolved_config_round_trips_without_runtime_fields(tmp_path):
    cfg = _load_quietly(RECIPE, ["rollout.sampling.stop_ids=[3]"])
    data = to_dict(cfg)
    assert set(data["rollout"]["sampling"]) == {
        "temperature", "top_p", "top_k", "stop_ids", "ignore_eos"
    }  # fmt: skip
    assert data["rollout"]["sampling"]["stop_ids"] == [3]
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    assert _load_quietly(path) == cfg


# One old key per entry: its YAML form, the value it sets and where it lands.
OLD_KEYS = {
    "rollout.temperature": ("0.5", ("sampling", "temperature"), 0.5),
    "rollout.top_p": ("0.9", ("sampling", "top_p"), 0.9),
    "rollout.top_k": ("4", ("sampling", "top_k"), 4),
    "rollout.stop_ids": ("[10]", ("sampling", "stop_ids"), (10,)),
    "rollout.engine": ("recompute", ("engine", "kind"), "recompute"),
    "rollout.kv_cache_gib": ("0.5", ("engine", "kv_cache_gib"), 0.5),
    "rollout.kv_cache_fraction": ("0.5", ("engine", "kv_cache_fraction"), 0.5),
    "rollout.cuda_graphs": ("false", ("engine", "cuda_graphs"), False),
    "rollout.max_prefill_tokens": ("64", ("engine", "max_prefill_tokens"), 64),
    "rollout.context_bucket": ("16", ("engine", "context_bucket"), 16),
    "rollout.decode_path": ("modules", ("engine", "decode_path"), "modules"),
}


# The LM-head keys that moved from ``training`` to the top-level ``lm_head`` section.
LM_HEAD_KEYS = {
    "training.logprob_path": ("op", "path", "op"),
    "training.lm_head_memory_budget": ("268435456", "memory_budget", 2**28),
}


def test_every_renamed_key_is_covered():
    assert set(OLD_KEYS) | set(LM_HEAD_KEYS) == set(RENAMED_KEYS)


@pytest.mark.parametrize("old", sorted(LM_HEAD_KEYS))
def test_lm_head_keys_moved_to_the_lm_head_section(old):
    raw, name, want = LM_HEAD_KEYS[old]
    with pytest.warns(FutureWarning) as record:
        cfg = load_train_config(RECIPE, [f"{old}={raw}"])
    assert getattr(cfg.lm_head, name) == want
    messages = [str(w.message) for w in record if w.category is FutureWarning]
    assert messages == [f"config key {old} is deprecated and will be removed: use lm_head.{name}"]


def test_lm_head_section_is_the_options_and_reaches_the_step():
    from megatron_grpo.megatron import GRPOStep
    from megatron_grpo.ops import LMHeadOptions

    sets = ["lm_head.path=op", "lm_head.memory_budget=268435456", "lm_head.gemm=separate"]
    cfg = _load_quietly(RECIPE, sets)
    assert type(cfg.lm_head) is LMHeadOptions and TrainConfig().lm_head == LMHeadOptions()
    options = dataclasses.replace(cfg.lm_head, temperature=0.7, vocab_size=cfg.model.vocab_size)
    step = GRPOStep.from_options(cfg.loss, options)
    assert step.options == LMHeadOptions(
        path="op", gemm="separate", memory_budget=2**28, temperature=0.7, vocab_size=13
    )
    assert "temperature" not in to_dict(cfg)["lm_head"]  # runtime-only: not a recipe key
    for bad, message in [
        ("lm_head.temperature=0.5", r"unknown config key 'lm_head\.temperature'"),
        ("lm_head.vocab_size=9", r"unknown config key 'lm_head\.vocab_size'"),
        ("lm_head.path=standard", r"lm_head\.path must be one of"),
        ("lm_head.memory_budget=1", r"lm_head\.memory_budget must be an int >="),
    ]:
        with pytest.raises(ConfigError, match=message):
            _load_quietly(RECIPE, [bad])
    with pytest.raises(ValueError, match="needs options.vocab_size"):
        GRPOStep.from_options(cfg.loss, cfg.lm_head)


@pytest.mark.parametrize("old", sorted(OLD_KEYS))
@pytest.mark.parametrize("where", ["yaml", "set"])
def test_old_keys_map_to_the_new_ones_with_one_warning(old, where, tmp_path):
    raw, (section, name), want = OLD_KEYS[old]
    key = old.split(".")[1]
    if where == "yaml":
        path, sets = _recipe(tmp_path, {key: yaml.safe_load(raw)}), []
    else:
        path, sets = RECIPE, [f"{old}={raw}"]
    with pytest.warns(FutureWarning) as record:
        cfg = load_train_config(path, sets)
    assert getattr(getattr(cfg.rollout, section), name) == want
    messages = [str(w.message) for w in record if w.category is FutureWarning]
    new = f"rollout.{section}.{name}"
    assert messages == [f"config key {old} is deprecated and will be removed: use {new}"]


def test_old_engine_string_beside_old_engine_keys(tmp_path):
    path = _recipe(tmp_path, {"engine": "recompute", "kv_cache_gib": 1.0, "top_k": 1})
    with pytest.warns(FutureWarning):
        cfg = load_train_config(path, ["rollout.engine=kv_cache", "rollout.context_bucket=8"])
    e = cfg.rollout.engine
    assert (e.kind, e.kv_cache_gib, e.context_bucket) == ("kv_cache", 1.0, 8)


def test_old_keys_warn_only_on_rank_0(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    cfg = _load_quietly(RECIPE, ["rollout.top_k=3"])
    assert cfg.rollout.sampling.top_k == 3


def test_old_and_new_key_both_set_is_an_error(tmp_path):
    both = {"temperature": 0.5, "sampling": {"temperature": 0.7}}
    match = "rollout.temperature and rollout.sampling.temperature are both set"
    with pytest.raises(ConfigError, match=match):
        load_train_config(_recipe(tmp_path, both), [])
    sets = ["rollout.kv_cache_gib=1", "rollout.engine.kv_cache_gib=2"]
    match = "rollout.kv_cache_gib and --set rollout.engine.kv_cache_gib are both given"
    with pytest.raises(ConfigError, match=match):
        load_train_config(RECIPE, sets)
    with pytest.raises(ConfigError, match="rollout.engine and --set rollout.engine.kind"):
        load_train_config(RECIPE, ["rollout.engine=recompute", "rollout.engine.kind=kv_cache"])
    # a recipe's old key with a new --set: the --set wins, as over any recipe value
    with pytest.warns(FutureWarning):
        cfg = load_train_config(_recipe(tmp_path, {"top_k": 2}), ["rollout.sampling.top_k=3"])
    assert cfg.rollout.sampling.top_k == 3


@pytest.mark.parametrize("recipe", sorted(p.name for p in RECIPES.glob("*.yaml")))
def test_recipes_use_the_new_keys(recipe):
    data = yaml.safe_load((RECIPES / recipe).read_text())
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        rename_keys(data, [], RENAMED_KEYS)


def test_the_sections_pass_through_to_generation(monkeypatch):
    """``sampling_params`` completes ``rollout.sampling``; the engine gets ``rollout.engine``."""
    from megatron_grpo.rollout import source as rollout_source

    cfg = _load_quietly(RECIPE, ["rollout.sampling.top_k=2", "rollout.sampling.stop_ids=[5]"])
    params = rollout_source.sampling_params(
        cfg.rollout, cfg.model.vocab_size, eos_id=12, task_stop_ids=[5, 6]
    )
    want = dataclasses.replace(
        cfg.rollout.sampling, max_new_tokens=cfg.rollout.max_response_length, eos_id=12,
        vocab_size=cfg.model.vocab_size, stop_ids=(5, 6),
    )  # fmt: skip
    assert params == want
    fake = type("FakeEngine", (), {"__init__": lambda self, model, o, ctx: setattr(self, "o", o)})
    fake.decode, fake.use_graphs, fake.graphs_off = "fake", False, ""
    fake.sizer = type("FakeSizer", (), {"memory": "KV cache from the allocator"})
    monkeypatch.setattr(rollout_source, "KVCacheEngine", fake)
    assert rollout_source.build_engine(cfg.rollout, model=None).o is cfg.rollout.engine
    recompute = _load_quietly(RECIPE, ["rollout.engine.kind=recompute"])
    assert rollout_source.build_engine(recompute.rollout, model=None) is None


def test_generation_needs_the_runtime_fields():
    from megatron_grpo.rollout.engine.model_io import check_prompts

    with pytest.raises(ValueError, match="needs max_new_tokens, eos_id, vocab_size to generate"):
        check_prompts([[1]], SamplingParams(), max_sequence_length=16)
    with pytest.raises(ValueError, match="eos_id 16 is outside the vocabulary"):
        SamplingParams(eos_id=16, vocab_size=16)


@pytest.mark.parametrize(
    ("recipe", "overrides", "why"),
    [
        ("tiny.yaml", ["parallel.tensor_model_parallel_size=1"], "TP is 1"),
        ("qwen3_8b_long_sp.yaml", ["rollout.engine.decode_path=modules"], "through the modules"),
        ("qwen3_8b_long_sp.yaml", ["rollout.colocated.weights=replica"], "TP is 1"),
        ("qwen3_30b_a3b_moe_twin.yaml", ["rollout.colocated.weights=shared"], "MoE layers"),
    ],
)
def test_decode_halves_are_checked_against_the_generating_layout(recipe, overrides, why):
    """``rollout.engine.decode_overlap: halves`` fails at load (``--check``, in seconds) where the
    engine would refuse it: TP 1 (also a replica's), the modules path, MoE layers."""
    sets = ["rollout.engine.decode_overlap=halves", "checkpoint.load=null", *overrides]
    with pytest.raises(ConfigError, match=f"decode_overlap: halves cannot run here: .*{why}"):
        _load_quietly(RECIPES / recipe, sets)
    loaded = _load_quietly(RECIPES / "qwen3_8b_long_sp.yaml", sets[:2])  # TP 4, dense, shared
    assert loaded.rollout.engine.decode_overlap == "halves"


@pytest.mark.parametrize(
    ("recipe", "overrides"),
    [
        ("tiny.yaml", ["parallel.tensor_model_parallel_size=1"]),
        ("qwen3_8b_long_sp.yaml", ["rollout.colocated.weights=replica"]),
    ],
)
@pytest.mark.parametrize("kernel", ["one_shot", "two_shot"])
def test_explicit_tp_all_reduce_kernels_need_a_tp_group(recipe, overrides, kernel):
    """An explicit symmetric-memory ``rollout.engine.tp_all_reduce`` where the engine decodes at
    TP 1 (also a replica's) fails at load instead of reducing nothing; TP 4 keeps it."""
    sets = [f"rollout.engine.tp_all_reduce={kernel}", "checkpoint.load=null", *overrides]
    with pytest.raises(ConfigError, match=f"tp_all_reduce: {kernel} cannot run here: .*TP 1"):
        _load_quietly(RECIPES / recipe, sets)
    loaded = _load_quietly(RECIPES / "qwen3_8b_long_sp.yaml", sets[:2])
    assert loaded.rollout.engine.tp_all_reduce == kernel


@pytest.mark.parametrize("kind", ["ring", "symm"])
def test_explicit_tp_overlap_needs_sequence_parallelism(kind):
    """``model.layer_kernels.tp_overlap`` ring / symm overlaps SP's collectives: at TP 1 or with
    SP off nothing would overlap, an error at load naming both fields; TP 4 + SP keeps it."""
    sets = [f"model.layer_kernels.tp_overlap={kind}", "checkpoint.load=null"]
    for extra, shown in (
        (["parallel.tensor_model_parallel_size=1"], "here 1, sequence_parallel true"),
        (["parallel.sequence_parallel=false"], "here 4, sequence_parallel false"),
    ):
        with pytest.raises(ConfigError, match=f"tp_overlap: {kind} overlaps .*{shown}"):
            _load_quietly(RECIPES / "qwen3_8b_long_sp.yaml", sets + extra)
    loaded = _load_quietly(RECIPES / "qwen3_8b_long_sp.yaml", sets)
    assert loaded.model.layer_kernels.tp_overlap == kind
