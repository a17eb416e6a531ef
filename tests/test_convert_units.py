"""Unit tests of the converter's pieces that need no Megatron model: layout transforms, name
maps, HF config mapping, streaming safetensors I/O, all-or-nothing output directories."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megatron_grpo.convert.errors import ConversionError
from megatron_grpo.convert.families import FAMILIES, family_for_architecture
from megatron_grpo.convert.hf_config import (
    check_same_architecture,
    hf_config_from_model,
    megatron_llama3_constants,
    model_config_from_hf,
)
from megatron_grpo.convert.outdir import atomic_output_dir
from megatron_grpo.convert.safetensors_io import (
    INDEX_NAME,
    PlannedTensor,
    SafetensorsReader,
    SafetensorsWriter,
)
from megatron_grpo.convert.transforms import GATE_UP, QKV, VOCAB, LayoutInfo
from megatron_grpo.megatron.config import ModelConfig
from megatron_grpo.megatron.parallel import cuda_compat

INFO = LayoutInfo(num_attention_heads=4, num_query_groups=2, head_dim=3, vocab_size=10,
                  padded_vocab_size=16)  # fmt: skip


def _rows(n: int, start: int) -> torch.Tensor:
    """[n, 2] rows labelled start, start+1, ... (column 1 = label too)."""
    labels = torch.arange(start, start + n, dtype=torch.float32)
    return torch.stack([labels, labels], dim=1)


def test_qkv_interleaves_per_query_group():
    d, per_q = INFO.head_dim, 2 * INFO.head_dim  # 2 query heads per group
    q, k, v = _rows(12, 0), _rows(6, 100), _rows(6, 200)
    fused = QKV.to_mcore([q, k, v], INFO)[0]
    expected = []
    for g in range(2):  # group g: its query heads, then its key head, then its value head
        expected += list(range(g * per_q, (g + 1) * per_q))
        expected += list(range(100 + g * d, 100 + (g + 1) * d))
        expected += list(range(200 + g * d, 200 + (g + 1) * d))
    assert fused[:, 0].tolist() == expected
    back = QKV.to_hf([fused], INFO)
    assert all(torch.equal(a, b) for a, b in zip(back, (q, k, v), strict=True))


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_qkv_round_trip_weights_and_bias(groups: int):
    info = LayoutInfo(4, groups, 5, 10, 16)
    g = torch.Generator().manual_seed(groups)
    for rest in [(7,), ()]:  # weight [rows, H] and bias [rows]
        q = torch.randn(20, *rest, generator=g)
        k, v = (
            torch.randn(groups * 5, *rest, generator=g),
            torch.randn(groups * 5, *rest, generator=g),
        )
        fused = QKV.to_mcore([q, k, v], info)[0]
        assert fused.shape[0] == 20 + 2 * groups * 5
        for a, b in zip(QKV.to_hf([fused], info), (q, k, v), strict=True):
            assert torch.equal(a, b)


def test_qkv_rejects_wrong_head_rows():
    with pytest.raises(ConversionError, match="k projection"):
        QKV.to_mcore([_rows(12, 0), _rows(5, 0), _rows(6, 0)], INFO)


def test_gate_up_fused_and_split_parts():
    gate, up = _rows(4, 0), _rows(4, 10)
    fused = GATE_UP.to_mcore([gate, up], INFO)[0]
    assert fused[:, 0].tolist() == list(range(4)) + list(range(10, 14))
    parts = GATE_UP.to_mcore([gate, up], INFO, num_parts=2)
    assert parts[0] is gate and parts[1] is up  # no copy for swiglu-split checkpoints
    assert all(
        torch.equal(a, b) for a, b in zip(GATE_UP.to_hf([fused], INFO), (gate, up), strict=True)
    )
    with pytest.raises(ConversionError, match="differ in shape"):
        GATE_UP.to_mcore([gate, _rows(3, 0)], INFO)


def test_vocab_pads_with_zeros_and_trims():
    emb = torch.randn(10, 3)
    padded = VOCAB.to_mcore([emb], INFO)[0]
    assert padded.shape == (16, 3) and torch.equal(padded[:10], emb)
    assert not padded[10:].any()
    # a checkpoint padded for another TP (more rows) trims back to the same tensor
    bigger = torch.cat([padded, torch.randn(16, 3)])
    assert torch.equal(VOCAB.to_hf([bigger], INFO)[0], emb)
    with pytest.raises(ConversionError, match="vocab_size"):
        VOCAB.to_mcore([torch.randn(11, 3)], INFO)


# Parameter names of the portable spec and the Transformer Engine spec / grouped experts.
_MCORE_NAMES = {
    "decoder.layers.3.input_layernorm.weight": ["model.layers.3.input_layernorm.weight"],
    "decoder.layers.3.self_attention.linear_qkv.layer_norm_weight": [
        "model.layers.3.input_layernorm.weight"
    ],
    "decoder.layers.0.mlp.experts.local_experts.7.linear_fc1.weight": [
        "model.layers.0.mlp.experts.7.gate_proj.weight",
        "model.layers.0.mlp.experts.7.up_proj.weight",
    ],
    "decoder.layers.1.mlp.experts.linear_fc2.weight12": [
        "model.layers.1.mlp.experts.12.down_proj.weight"
    ],
    "output_layer.weight": ["lm_head.weight"],
}


@pytest.mark.parametrize("name", sorted(_MCORE_NAMES))
def test_name_map_templates(name: str):
    rule, fields = FAMILIES["qwen3_moe"].rule_for(name)
    assert rule.hf_names(fields) == _MCORE_NAMES[name]


def test_name_map_rejects_unknown_parameters_and_architectures():
    with pytest.raises(ConversionError, match="no HF tensor maps"):
        FAMILIES["llama"].rule_for("decoder.layers.0.self_attention.linear_qkv.bias")
    with pytest.raises(ConversionError, match="unsupported architecture.*GPT2LMHeadModel"):
        family_for_architecture(["GPT2LMHeadModel"], "gpt2")
    assert family_for_architecture(["Qwen2ForCausalLM"], None).name == "qwen2"


def _hf_config(model_type: str, **kw):
    from transformers import CONFIG_MAPPING

    base = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0)  # fmt: skip
    if model_type == "qwen3_moe":
        base.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    return CONFIG_MAPPING[model_type](**{**base, **kw})


def test_model_config_from_hf_fields():
    cfg = model_config_from_hf(_hf_config("qwen2", tie_word_embeddings=True), FAMILIES["qwen2"])
    assert (cfg.num_attention_heads, cfg.num_query_groups, cfg.head_dim) == (4, 2, 8)
    assert cfg.add_qkv_bias and not cfg.qk_layernorm and cfg.share_embeddings_and_output_weights
    assert cfg.rotary_base == 10000 and cfg.vocab_size == 300
    moe = model_config_from_hf(_hf_config("qwen3_moe", head_dim=16), FAMILIES["qwen3_moe"])
    assert (moe.num_moe_experts, moe.moe_router_topk, moe.moe_ffn_hidden_size) == (4, 2, 16)
    assert moe.kv_channels == 16 and moe.qk_layernorm
    # norm_topk_prob=False: softmax over all experts, no renormalization = pre-softmax
    assert moe.moe_router_pre_softmax is True


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_hf_config_round_trip(family: str):
    fam = FAMILIES[family]
    extra = {"norm_topk_prob": True} if fam.moe else {}
    cfg = model_config_from_hf(_hf_config(family, **extra), fam)
    from transformers import CONFIG_MAPPING

    raw = hf_config_from_model(cfg, fam)
    assert raw["architectures"] == [fam.architectures[0]]
    again = model_config_from_hf(CONFIG_MAPPING[family](**raw), fam)
    check_same_architecture(cfg, again, "round trip")  # every ARCHITECTURE_FIELDS entry
    assert again.head_dim == cfg.head_dim and again.max_sequence_length == cfg.max_sequence_length


def _llama3(**kw) -> dict:
    """HF rope_scaling of Llama 3.1 (megatron-core's hard-coded values), overridden by ``kw``."""
    return {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192, **kw}  # fmt: skip


def test_megatron_llama3_constants_are_the_ones_megatron_applies():
    """The values read from megatron-core's signature are what its RotaryEmbedding computes: its
    inverse frequencies equal transformers' llama3 ones for an HF config holding those values."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    assert megatron_llama3_constants() == {
        "low_freq_factor": 1, "high_freq_factor": 4, "original_max_position_embeddings": 8192
    }  # fmt: skip
    hf = _hf_config(
        "llama", hidden_size=256, rope_theta=500000.0, rope_scaling=_llama3(factor=32.0)
    )
    want, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    rope = RotaryEmbedding(64, 1.0, rotary_base=500000, rope_scaling=True,
                           rope_scaling_factor=32.0, use_cpu_initialization=True)  # fmt: skip
    plain = RotaryEmbedding(64, 1.0, rotary_base=500000, use_cpu_initialization=True)
    assert attention_factor == 1.0 and torch.allclose(rope.inv_freq, want, rtol=1e-6, atol=0)
    assert not torch.allclose(plain.inv_freq, want)  # the scaling changes these frequencies


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_llama3_rope_scaling_maps_both_ways(family: str):
    from transformers import CONFIG_MAPPING

    fam = FAMILIES[family]
    cfg = model_config_from_hf(_hf_config(family, rope_scaling=_llama3(factor=32.0)), fam)
    assert cfg.rope_scaling and cfg.rope_scaling_factor == 32.0 and cfg.rotary_base == 10000
    raw = hf_config_from_model(cfg, fam)
    params = raw.get("rope_parameters") or {**raw["rope_scaling"], "rope_theta": raw["rope_theta"]}
    assert params == {**_llama3(factor=32.0), "rope_theta": 10000.0}
    again = model_config_from_hf(CONFIG_MAPPING[family](**raw), fam)
    check_same_architecture(cfg, again, "round trip")
    plain = model_config_from_hf(_hf_config(family), fam)
    assert not plain.rope_scaling
    with pytest.raises(ConversionError, match="rope_scaling is False, but the checkpoint has True"):
        check_same_architecture(cfg, plain, "x")


def _yarn(**kw) -> dict:
    return {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, **kw}


@pytest.mark.parametrize(
    "hf_yarn, megatron",
    [
        # transformers' default attention factor 0.1 ln(factor) + 1 = megatron's default
        (_yarn(), dict(yarn_mscale=1.0, yarn_mscale_all_dim=0.0)),
        # DeepSeek style: mscale(f, 0.707) / mscale(f, 0.707) = 1
        (_yarn(mscale=0.707, mscale_all_dim=0.707, beta_fast=16.0, truncate=False),
         dict(yarn_mscale=0.707, yarn_mscale_all_dim=0.707, yarn_beta_fast=16.0,
              yarn_correction_range_round_to_int=False)),
        # mscale alone is ignored by transformers (it needs both): megatron's default again
        (_yarn(mscale=0.5), dict(yarn_mscale=1.0, yarn_mscale_all_dim=0.0)),
        # an explicit attention factor equal to the derived one
        (_yarn(attention_factor=0.1 * math.log(4.0) + 1), dict(yarn_mscale=1.0)),
    ],
)  # fmt: skip
def test_yarn_maps_both_ways(hf_yarn: dict, megatron: dict):
    from transformers import CONFIG_MAPPING
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    fam = FAMILIES["qwen3"]
    hf = _hf_config("qwen3", head_dim=16, max_position_embeddings=128, rope_scaling=hf_yarn)
    cfg = model_config_from_hf(hf, fam)
    assert cfg.position_embedding_type == "yarn" and cfg.yarn_rotary_scaling_factor == 4.0
    assert cfg.yarn_original_max_position_embeddings == 32
    assert {k: getattr(cfg, k) for k in megatron} == megatron
    again = model_config_from_hf(CONFIG_MAPPING["qwen3"](**hf_config_from_model(cfg, fam)), fam)
    check_same_architecture(cfg, again, "round trip")
    # megatron-core's frequencies and attention factor equal transformers'
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        YarnRotaryEmbedding,
        _yarn_get_concentration_factor,
    )

    want_freq, want_factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    with cuda_compat():
        rope = YarnRotaryEmbedding(
            16, rotary_base=cfg.rotary_base, scaling_factor=cfg.yarn_rotary_scaling_factor,
            original_max_position_embeddings=32, beta_fast=cfg.yarn_beta_fast,
            beta_slow=cfg.yarn_beta_slow, mscale=cfg.yarn_mscale,
            mscale_all_dim=cfg.yarn_mscale_all_dim, use_cpu_initialization=True,
            correction_range_round_to_int=cfg.yarn_correction_range_round_to_int,
        )  # fmt: skip
        emb, factor = rope.get_emb(4)
    assert factor == pytest.approx(want_factor, rel=1e-12)
    assert factor == _yarn_get_concentration_factor(4.0, cfg.yarn_mscale, cfg.yarn_mscale_all_dim)
    torch.testing.assert_close(emb[1, 0, 0, :8].float(), want_freq, rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"yarn_beta_fast": 16.0}, "yarn_beta_fast: no effect with position_embedding_type='rope'"),
        ({"position_embedding_type": "yarn"}, "needs yarn_rotary_scaling_factor and yarn_orig"),
        ({"position_embedding_type": "yarn", "yarn_rotary_scaling_factor": 4.0,
          "yarn_original_max_position_embeddings": 32, "rope_scaling": True}, "rope_scaling needs"),
        ({"position_embedding_type": "yarn", "yarn_rotary_scaling_factor": 4.0,
          "yarn_original_max_position_embeddings": 32, "rotary_interleaved": True},
         "rotary_interleaved=false"),
        ({"position_embedding_type": "yarn", "yarn_rotary_scaling_factor": -1.0,
          "yarn_original_max_position_embeddings": 32}, "yarn_rotary_scaling_factor must be posi"),
    ],
)  # fmt: skip
def test_model_config_yarn_validation(changes: dict, match: str):
    with pytest.raises(ValueError, match=match):
        ModelConfig(vocab_size=300, **changes)


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"rope_scaling": True, "position_embedding_type": "learned_absolute"},
         "rope_scaling needs position_embedding_type='rope', got 'learned_absolute'"),
        ({"rope_scaling_factor": 32.0}, "rope_scaling_factor=32.0 has no effect unless rope_sc"),
        ({"rope_scaling": True, "rope_scaling_factor": 0.0}, "rope_scaling_factor must be posit"),
    ],
)  # fmt: skip
def test_model_config_rope_scaling_validation(changes: dict, match: str):
    from megatron_grpo.config import from_dict

    with pytest.raises(ValueError, match=match):
        ModelConfig(vocab_size=300, **changes)
    cfg = from_dict(
        ModelConfig, {"vocab_size": 300, "rope_scaling": True, "rope_scaling_factor": 32}
    )
    assert cfg.rope_scaling_factor == 32.0


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"normalization": "LayerNorm"}, "normalization"),
        ({"rotary_interleaved": True}, "rotary_interleaved"),
        ({"activation_func": "gelu"}, "activation_func"),
        ({"position_embedding_type": "learned_absolute"}, "position_embedding_type"),
    ],
)
def test_generated_hf_config_refuses_what_hf_cannot_express(changes: dict, field: str):
    cfg = ModelConfig(vocab_size=300, hidden_size=32, **changes)
    with pytest.raises(
        ConversionError, match=f"llama config.json cannot express this model .*: {field} is"
    ):
        hf_config_from_model(cfg, FAMILIES["llama"])


def test_generated_hf_config_keeps_partial_rotary():
    cfg = ModelConfig(vocab_size=300, hidden_size=32, rotary_percent=0.5)
    raw = hf_config_from_model(cfg, FAMILIES["llama"])  # checks its own round trip
    assert (raw.get("rope_parameters") or raw)["partial_rotary_factor"] == 0.5


@pytest.mark.parametrize(
    "model_type, kw, match",
    [
        ("llama", {"rope_scaling": _llama3(original_max_position_embeddings=16)},
         r"rope_scaling.original_max_position_embeddings=16 is unsupported: megatron-core's "
         r"llama3 RoPE scaling hard-codes original_max_position_embeddings=8192"),
        ("llama", {"rope_scaling": _llama3(low_freq_factor=2.0)},
         r"rope_scaling.low_freq_factor=2.0 .* hard-codes low_freq_factor=1\b"),
        ("llama", {"rope_scaling": _llama3(high_freq_factor=3.0)},
         r"rope_scaling.high_freq_factor=3.0 .* hard-codes high_freq_factor=4\b"),
        ("qwen2", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                    "original_max_position_embeddings": 32,
                                    "attention_factor": 1.5}},
         r"attention_factor=1.5 is unsupported: megatron-core derives 1.138"),
        ("qwen2", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                    "original_max_position_embeddings": 32},
                   "partial_rotary_factor": 0.5},
         "YaRN .* rotates the whole head dimension"),
        ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
         "'linear' .* is unsupported: megatron-core's GPTModel takes Llama 3 scaling"),
        ("llama", {"hidden_act": "gelu"}, "hidden_act"),
        ("llama", {"attention_bias": True}, "attention_bias"),
        ("llama", {"mlp_bias": True}, "mlp_bias"),
        ("qwen3_moe", {"mlp_only_layers": [1]}, "mlp_only_layers"),
        ("qwen2_moe", {"decoder_sparse_step": 2}, "decoder_sparse_step"),
        ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise=0.1 is unsupported"),
        ("llama", {"num_key_value_heads": 3}, "num_query_groups=3"),
    ],
)  # fmt: skip
def test_model_config_from_hf_rejects(model_type: str, kw: dict, match: str):
    with pytest.raises(ConversionError, match=match):
        model_config_from_hf(_hf_config(model_type, **kw), FAMILIES[model_type])


def _plan(tensors: dict[str, torch.Tensor]) -> list[PlannedTensor]:
    return [PlannedTensor(n, tuple(t.shape), t.dtype) for n, t in tensors.items()]


def test_writer_shards_and_reader_maps(tmp_path: Path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        f"t{i}": torch.randn(5, 4, generator=g).to(dt)
        for i, dt in enumerate([torch.float32, torch.bfloat16, torch.float16, torch.float32])
    }
    tensors["empty"] = torch.zeros(0, 3)
    writer = SafetensorsWriter(tmp_path, _plan(tensors), max_shard_bytes=100)
    for name, t in tensors.items():
        writer.write(name, t)
    writer.close()
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    assert len(set(index["weight_map"].values())) == len(writer.files) > 1
    reader = SafetensorsReader(tmp_path)
    for name, t in tensors.items():
        got = reader.get(name)
        assert got.dtype == t.dtype and torch.equal(got, t)
        with safe_open(tmp_path / index["weight_map"][name], "pt") as f:  # the reference reader
            assert torch.equal(f.get_tensor(name), t)


def test_writer_enforces_plan_order(tmp_path: Path):
    t = {"a": torch.ones(2), "b": torch.ones(3)}
    writer = SafetensorsWriter(tmp_path, _plan(t), max_shard_bytes=1 << 20)
    with pytest.raises(RuntimeError, match="mismatch"):
        writer.write("b", t["b"])


def test_reader_errors_name_the_problem(tmp_path: Path):
    save_file({"a": torch.ones(4)}, tmp_path / "model-1.safetensors")
    index = {"weight_map": {"a": "model-1.safetensors", "b": "model-2.safetensors"}}
    (tmp_path / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(ConversionError, match="missing shard file.*model-2.safetensors"):
        SafetensorsReader(tmp_path)
    save_file({"c": torch.ones(4)}, tmp_path / "model-2.safetensors")
    with pytest.raises(ConversionError, match=r"absent tensors \['b'\]"):
        SafetensorsReader(tmp_path)
    raw = (tmp_path / "model-1.safetensors").read_bytes()
    (tmp_path / "model-1.safetensors").write_bytes(raw[:-4])  # truncated data
    index["weight_map"]["c"] = index["weight_map"].pop("b")
    (tmp_path / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(ConversionError, match="outside the file"):
        SafetensorsReader(tmp_path)
    with pytest.raises(ConversionError, match="no model.safetensors"):
        SafetensorsReader(tmp_path / "nowhere")


def test_reader_tensors_are_copy_on_write(tmp_path: Path):
    save_file({"a": torch.arange(4.0)}, tmp_path / "model.safetensors")
    t = SafetensorsReader(tmp_path).get("a")
    t.add_(1)  # must not reach the file
    assert torch.equal(SafetensorsReader(tmp_path).get("a"), torch.arange(4.0))


def test_atomic_output_dir_leaves_nothing_on_error(tmp_path: Path):
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="boom"), atomic_output_dir(out) as tmp:
        (tmp / "half.bin").write_bytes(b"x")
        raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []
    with atomic_output_dir(out) as tmp:
        (tmp / "done").write_text("ok")
    assert (out / "done").read_text() == "ok" and sorted(tmp_path.iterdir()) == [out]
    with pytest.raises(ConversionError, match="not empty"), atomic_output_dir(out):
        pass


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_atomic_output_dir_honours_the_umask(tmp_path: Path, umask: int):
    """The output directory gets the mode mkdir would give it (mkdtemp alone makes it 0700:
    unreadable for the rest of a shared cluster)."""
    old = os.umask(umask)
    try:
        with atomic_output_dir(tmp_path / "out") as tmp:
            (tmp / "f").write_text("x")
    finally:
        os.umask(old)
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o777 & ~umask
