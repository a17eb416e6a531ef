"""End-to-end conversion of tiny random transformers models (every supported family, tied and
untied embeddings): logits of the converted Megatron GPTModel at TP=1 and TP=2 (gloo) equal the
transformers forward in fp32, mcore -> hf round trips are bit-identical, bad input fails cleanly.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from megatron_grpo.convert import ConversionError, hf_to_mcore, mcore_to_hf, verify_conversion
from megatron_grpo.convert.verify import hf_logits, load_megatron_model, model_logits, prompt_ids
from tests.dist_utils import run_distributed

TOL = 1e-4
# vocab 300: padded to 384 at TP=1 and 512 at TP=2, so TP=2 loads exercise vocab resharding.
_BASE = dict(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
# Llama 3.1 rope scaling (megatron-core hard-codes low 1 / high 4 / original 8192). head_dim 16 and
# theta 5e5 put 3 of 8 frequencies above the 8192 wavelength (divided by 8) and 1 in the smoothed
# band; LONG_SEQ positions turn them by up to ~0.4 rad, so the scaling moves the logits visibly.
_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192}  # fmt: skip
_LLAMA3_KW = dict(head_dim=16, rope_theta=500000.0, max_position_embeddings=16384)
# YaRN (Qwen3 past 32k): original context 64, factor 4. head_dim 16 and theta 1e4 put the ramp
# over frequencies 0-3 of 8; the rest are divided by 4 and cos/sin scale by 0.1 ln 4 + 1.
_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
_YARN_KW = dict(head_dim=16, rope_theta=10000.0, max_position_embeddings=256)
LONG_SEQ = 256
SCALED = ("llama3_rope", "qwen3_yarn")
CASES = {
    "llama": ("llama", {}),
    "llama3_rope": ("llama", {"rope_scaling": _LLAMA3, **_LLAMA3_KW}),
    "llama_tied": ("llama", {"tie_word_embeddings": True}),
    "mistral": ("mistral", {"head_dim": 16}),  # head_dim != hidden / heads
    "qwen2": ("qwen2", {}),
    "qwen2_tied": ("qwen2", {"tie_word_embeddings": True}),
    "qwen3_tied": ("qwen3", {"head_dim": 8, "tie_word_embeddings": True}),
    "qwen3_yarn": ("qwen3", {"rope_scaling": _YARN, **_YARN_KW}),
    "qwen3_moe": ("qwen3_moe", {"head_dim": 8, **_MOE}),
    "qwen3_moe_norm_topk": ("qwen3_moe", {"head_dim": 8, "norm_topk_prob": True, **_MOE}),
    # shared expert (gated by sigmoid(shared_expert_gate)) + QKV bias; no top-k renormalization
    "qwen2_moe": ("qwen2_moe", {**_MOE, "shared_expert_intermediate_size": 24}),
    # experts as block_sparse_moe.experts.<e>.w1/w3/w2; the top-k always renormalized
    "mixtral": (
        "mixtral",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 16},
    ),  # fmt: skip
}


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights well away from init (norm gains != 1, biases != 0) so a swapped or mis-laid
    tensor changes the logits visibly."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.2 * noise if "norm" in name else 0.15 * noise)


def save_tiny_hf(model_type: str, overrides: dict, out: Path, seed: int = 0, **save_kw) -> Path:
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    cfg = CONFIG_MAPPING[model_type](**{**_BASE, **overrides})
    model = AutoModelForCausalLM.from_config(cfg)
    _randomize(model, seed)
    model.save_pretrained(out, **save_kw)
    return out


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    root = tmp_path_factory.mktemp("convert")
    out = {}
    for i, (case, (model_type, kw)) in enumerate(CASES.items()):
        hf = save_tiny_hf(model_type, kw, root / case / "hf", seed=i)
        out[case] = (hf, hf_to_mcore(hf, root / case / "mcore"))
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_tp1_match_transformers(converted, case: str):
    hf, ckpt = converted[case]
    assert verify_conversion(hf, ckpt, tp=1) <= TOL


@pytest.mark.parametrize("case", sorted(CASES))
def test_mcore_to_hf_round_trip_is_identical(converted, tmp_path: Path, case: str):
    from safetensors.torch import load_file

    hf, ckpt = converted[case]
    # several output shards, and several partial reads of the layer-stacked checkpoint tensors
    out = mcore_to_hf(ckpt, tmp_path / "hf", max_shard_bytes=20_000, load_batch_bytes=20_000)
    assert (out / "model.safetensors.index.json").is_file()
    src = load_file(hf / "model.safetensors")
    got = {}
    for f in sorted(out.glob("*.safetensors")):
        got.update(load_file(f))
    if CASES[case][1].get("tie_word_embeddings"):
        src.pop("lm_head.weight", None)  # tied: HF may or may not store it; we do not
    assert sorted(got) == sorted(src)
    for name, t in src.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    cfg_src = json.loads((hf / "config.json").read_text())
    cfg_out = json.loads((out / "config.json").read_text())
    for key in ("architectures", "hidden_size", "num_key_value_heads", "tie_word_embeddings"):
        assert cfg_out[key] == cfg_src[key], key
    for key in ("rope_parameters", "rope_scaling", "rope_theta"):  # 5.x / 4.x spellings
        assert cfg_out.get(key) == cfg_src.get(key), key


def _seq_len(case: str) -> int:
    return LONG_SEQ if "rope_scaling" in CASES[case][1] else 16


@pytest.mark.parametrize("case", SCALED)
def test_rope_scaling_long_sequences(converted, tmp_path: Path, case: str):
    """Sequences of LONG_SEQ tokens: the converted model matches transformers' llama3 / YaRN
    RoPE, and the same weights without the scaling do not (so this comparison can fail)."""
    from megatron_grpo.convert.mcore_io import single_process_megatron
    from megatron_grpo.convert.verify import megatron_logits

    hf, ckpt = converted[case]
    ids = prompt_ids(hf, 300, seq_len=LONG_SEQ)
    ref = hf_logits(hf, ids)
    with single_process_megatron():
        got = megatron_logits(ckpt, ids)
    assert _max_diff(ref, got) <= TOL
    theta = CASES[case][1]["rope_theta"]
    plain = _edit_config(hf, tmp_path / "plain", rope_scaling=None, rope_parameters=None,
                         rope_theta=theta)  # fmt: skip
    assert _max_diff(ref, hf_logits(plain, ids)) > 100 * TOL


@pytest.mark.parametrize("case", SCALED)
def test_rope_scaling_generated_config(converted, tmp_path: Path, case: str):
    """mcore-to-hf without hf/ assets writes the rope scaling back into config.json."""
    hf, ckpt = converted[case]
    bare = tmp_path / "bare"
    shutil.copytree(ckpt, bare, ignore=shutil.ignore_patterns("hf"))
    out = mcore_to_hf(bare, tmp_path / "hf", family=CASES[case][0])
    ids = prompt_ids(hf, 300, seq_len=LONG_SEQ)
    assert _max_diff(hf_logits(hf, ids), hf_logits(out, ids)) == 0.0
    cfg = json.loads((out / "config.json").read_text())
    params = cfg.get("rope_parameters") or {**cfg["rope_scaling"], "rope_theta": cfg["rope_theta"]}
    want = _LLAMA3 if case == "llama3_rope" else {**_YARN, "beta_fast": 32.0, "beta_slow": 1.0,
                                                  "truncate": True}  # fmt: skip
    assert params == {**want, "rope_theta": CASES[case][1]["rope_theta"]}


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def _tp2_body(rank: int, world: int, cases: dict, refs: dict, resave: dict) -> None:
    from megatron.core import dist_checkpointing

    from megatron_grpo.convert.mcore_io import checkpoint_io
    from megatron_grpo.megatron.config import ParallelConfig
    from megatron_grpo.megatron.parallel import destroy_parallel, initialize_parallel

    initialize_parallel(ParallelConfig(tensor_model_parallel_size=world), seed=0)
    for case, (ckpt, ids) in cases.items():
        model = load_megatron_model(ckpt)
        got = model_logits(model, 300, ids)
        diff = max(float((a - b).abs().max()) for a, b in zip(got, refs[case], strict=True))
        assert diff <= TOL, f"{case}: TP={world} max |logit diff| {diff}"
        if case in resave:  # a checkpoint as a TP=2 trainer writes it (vocab padded to 512)
            with checkpoint_io():
                dist_checkpointing.save(model.sharded_state_dict(), resave[case])
    destroy_parallel()


@pytest.mark.slow
def test_logits_tp2_match_transformers(converted, tmp_path: Path):
    """One spawned TP=2 world loads every converted checkpoint (resharding TP=1 -> TP=2) and
    re-saves three at TP=2; exporting those gives the original HF tensors back."""
    from safetensors.torch import load_file

    cases, refs = {}, {}
    for case, (hf, ckpt) in converted.items():
        ids = prompt_ids(hf, 300, seq_len=_seq_len(case))
        cases[case] = (str(ckpt), ids)
        refs[case] = hf_logits(hf, ids)
    resave = {c: tmp_path / c for c in ("llama_tied", "qwen3_moe", "qwen2_moe")}
    for path in resave.values():
        path.mkdir()
    run_distributed(_tp2_body, 2, cases, refs, {c: str(p) for c, p in resave.items()})
    for case, path in resave.items():
        hf, ckpt = converted[case]
        out = mcore_to_hf(
            path, tmp_path / f"{case}_hf", hf_config_dir=hf, model_config=ckpt / "model_config.yaml"
        )
        src, got = load_file(hf / "model.safetensors"), load_file(out / "model.safetensors")
        assert sorted(got) == sorted(src) and all(torch.equal(got[k], src[k]) for k in src)


def test_bfloat16_checkpoint(converted, tmp_path: Path):
    from safetensors.torch import load_file

    hf, _ = converted["qwen2"]
    ckpt = hf_to_mcore(hf, tmp_path / "bf16", dtype="bfloat16")
    assert verify_conversion(hf, ckpt) < 0.1  # bf16-rounded weights vs fp32 ones
    # against transformers with its weights rounded the same way: the conversion alone
    assert verify_conversion(hf, ckpt, weight_dtype=torch.bfloat16) <= TOL
    # --verify at the default tolerance passes for an fp32 source written as bf16
    hf_to_mcore(hf, tmp_path / "bf16_verified", dtype="bfloat16", verify=True)
    out = mcore_to_hf(ckpt, tmp_path / "hf", dtype="float32")
    src, got = load_file(hf / "model.safetensors"), load_file(out / "model.safetensors")
    for name, t in src.items():
        assert torch.equal(got[name], t.to(torch.bfloat16).float()), name
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"


def test_mcore_to_hf_verify_with_a_dtype_cast(converted, tmp_path: Path, capsys):
    """mcore-to-hf --dtype --verify compares against Megatron with its weights rounded to the
    exported dtype: it passes at the default tolerance where the plain comparison (fp32 Megatron
    weights vs the cast export) fails, also at TP=2, and says what it rounded."""
    hf, ckpt = converted["qwen2"]  # an fp32 checkpoint
    out = mcore_to_hf(ckpt, tmp_path / "bf16", dtype="bfloat16", verify=True)
    printed = capsys.readouterr().out
    assert "(TP=1, both with weights rounded to bfloat16 as --dtype wrote them)" in printed
    assert verify_conversion(out, ckpt) > 1e-3  # the cast's own rounding, not the conversion's
    assert verify_conversion(out, ckpt, weight_dtype=torch.bfloat16) <= TOL
    out16 = mcore_to_hf(ckpt, tmp_path / "fp16", dtype="float16", verify=True, verify_tp=2)
    assert "(TP=2, both with weights rounded to float16" in capsys.readouterr().out
    assert json.loads((out16 / "config.json").read_text())["dtype"] == "float16"
    # a tolerance below the conversion's own difference still fails, and leaves nothing behind
    with pytest.raises(ConversionError, match="verification failed"):
        mcore_to_hf(ckpt, tmp_path / "strict", dtype="bfloat16", verify=True, verify_tol=1e-12)
    assert not (tmp_path / "strict").exists()


def test_tensors_handed_to_the_writer_are_file_backed(converted, tmp_path: Path, monkeypatch):
    """Streaming: every tensor dist_checkpointing writes is a memory map of exactly its own
    bytes (no anonymous copy of the model, nothing Megatron's writer must clone)."""
    import importlib

    module = importlib.import_module("megatron_grpo.convert.hf_to_mcore")  # not the function
    seen = []
    real_save = module.save_checkpoint

    def spy(tensors, others, ckpt_dir):
        maps = [line.split() for line in Path("/proc/self/maps").read_text().splitlines()]
        files = [
            tuple(int(x, 16) for x in m[0].split("-")) for m in maps if len(m) > 5 and "/" in m[5]
        ]
        for name, parts in tensors.items():
            for p in parts:
                ptr, size = p.data.data_ptr(), p.data.untyped_storage().nbytes()
                in_file = any(lo <= ptr < hi for lo, hi in files)
                seen.append((name, in_file, size == p.data.numel() * p.data.element_size()))
        real_save(tensors, others, ckpt_dir)

    if not Path("/proc/self/maps").is_file():
        pytest.skip("needs /proc/self/maps")
    monkeypatch.setattr(module, "save_checkpoint", spy)
    hf, _ = converted["qwen3_moe"]
    hf_to_mcore(hf, tmp_path / "out")
    assert seen and all(in_file and exact for _, in_file, exact in seen), seen


def _edit_config(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, "unsupported architecture"),
        ({"num_hidden_layers": 1}, "no Megatron counterpart: model.layers.1"),
        ({"num_hidden_layers": 3}, r"missing HF tensor\(s\) \['model.layers.2"),
        ({"intermediate_size": 40}, "config.json implies"),
        ({"num_key_value_heads": 3}, "num_query_groups=3 must divide"),
    ],
)
def test_bad_input_fails_cleanly(converted, tmp_path: Path, changes: dict, match: str):
    hf = _edit_config(converted["llama"][0], tmp_path / "hf", **changes)
    with pytest.raises(ConversionError, match=match):
        hf_to_mcore(hf, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # nothing half-written


def test_missing_shard_fails_cleanly(tmp_path: Path):
    hf = save_tiny_hf("llama", {}, tmp_path / "hf", max_shard_size="30KB")
    shards = sorted(hf.glob("*.safetensors"))
    assert len(shards) > 1
    shards[-1].unlink()
    with pytest.raises(ConversionError, match=f"missing shard file.*{shards[-1].name}"):
        hf_to_mcore(hf, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_verify_tp_not_dividing_heads_fails_cleanly(converted, tmp_path: Path):
    hf, _ = converted["qwen2"]
    with pytest.raises(ConversionError, match="TP=3.*must divide model.num_attention_heads"):
        hf_to_mcore(hf, tmp_path / "out", verify=True, verify_tp=3)
    assert list(tmp_path.iterdir()) == []


def test_mcore_to_hf_checks_config_agreement(converted, tmp_path: Path):
    _, ckpt = converted["qwen3_tied"]
    bad = _edit_config(ckpt / "hf", tmp_path / "hfcfg", rope_theta=5.0, rope_parameters=None)
    with pytest.raises(ConversionError, match="rotary_base is 5"):
        mcore_to_hf(ckpt, tmp_path / "out", hf_config_dir=bad)
    _, llama3 = converted["llama3_rope"]
    scaled = dict(rope_parameters={**_LLAMA3, "factor": 4.0, "rope_theta": 500000.0})
    bad = _edit_config(llama3 / "hf", tmp_path / "hfcfg3", rope_scaling=None, **scaled)
    with pytest.raises(
        ConversionError, match="rope_scaling_factor is 4.0, but the checkpoint has 8"
    ):
        mcore_to_hf(llama3, tmp_path / "out", hf_config_dir=bad)
    with pytest.raises(ConversionError, match="model_config.yaml: missing"):
        mcore_to_hf(ckpt / "hf", tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hfcfg", "hfcfg3"]


def test_generated_config_without_hf_assets(converted, tmp_path: Path):
    """A checkpoint without hf/ (e.g. a trainer checkpoint): --family generates config.json."""
    hf, ckpt = converted["qwen3_moe"]
    bare = tmp_path / "bare"
    shutil.copytree(ckpt, bare, ignore=shutil.ignore_patterns("hf"))
    with pytest.raises(ConversionError, match="pass --family"):
        mcore_to_hf(bare, tmp_path / "x")
    out = mcore_to_hf(bare, tmp_path / "hf", family="qwen3_moe", verify=True)
    assert verify_conversion(out, ckpt) <= TOL


def test_cli(converted, tmp_path: Path, capsys):
    import importlib.util

    path = Path(__file__).parents[1] / "tools" / "convert_checkpoint.py"
    spec = importlib.util.spec_from_file_location("convert_checkpoint", path)
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    hf, _ = converted["llama_tied"]
    ckpt, back = tmp_path / "mc", tmp_path / "back"
    assert cli.main(["hf-to-mcore", "--hf", str(hf), "--out", str(ckpt), "--verify"]) == 0
    assert "max |logit difference|" in capsys.readouterr().out
    args = ["mcore-to-hf", "--ckpt", str(ckpt), "--out", str(back), "--max-shard-size", "1MiB"]
    assert cli.main(args) == 0
    assert cli.main(["hf-to-mcore", "--hf", str(hf), "--out", str(ckpt)]) == 2
    assert "already exists and is not empty" in capsys.readouterr().err
