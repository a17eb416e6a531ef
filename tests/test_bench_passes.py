"""tools/bench_passes (behind tools/bench_train_passes.py): the flags' presets and checks, the
FLOP / MFU arithmetic, the process-layout checks and the comparison table, without a model."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from bench_passes import cli, dist, flops, shapes  # noqa: E402
from bench_passes.batches import batch_seed, doc_lens  # noqa: E402
from bench_passes.models import check_variants, layer_kernels  # noqa: E402
from bench_passes.profiling import _busy_us  # noqa: E402
from bench_passes.report import comparison  # noqa: E402

from megatron_grpo.megatron import pack_sequences  # noqa: E402


def test_presets_and_defaults():
    a = cli.parse_args(["--device", "cpu"])  # the CPU run is the tiny dry run
    assert a.tiny and (a.layers, a.hidden, a.vocab, a.tied) == (2, 64, 512, True)
    assert (a.micro_batches, a.tokens, a.doc_lens, a.warmup, a.iters) == (2, 256, [256, 32], 1, 1)
    a = cli.parse_args(["--moe", "--experts", "sequential, grouped", "--tokens", "4096"])
    assert (a.num_experts, a.topk, a.moe_ffn, a.tied) == (128, 8, 768, False)
    assert a.experts == ["sequential", "grouped"] and a.doc_lens == [4096]  # L cut to --tokens
    a = cli.parse_args(["--dense8b", "--tp", "1,2,4", "--mixed", "100-4000", "--layers", "2"])
    assert (a.hidden, a.ffn, a.layers, a.tp, a.tp_size) == (4096, 12288, 2, [1, 2, 4], None)
    assert a.doc_lens == [8192, 1024, 128, 32, "100-4000"] and a.profile_len == 32
    assert shapes.preset(tiny=True, moe=False, dense8b=True) is shapes.TINY


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--dense8b", "--moe"], "--dense8b and --moe are two shapes"),
        (["--moe", "--tp", "2"], "--tp: the dense models only"),
        (["--moe", "--experts", "grouped,fast"], "--experts: each of"),
        (["--ep", "2"], "--ep 2: a positive size, > 1 only with --moe"),
        (["--doc-lens", "8,1"], "--doc-lens and --tokens must be >= 2"),
        (["--mixed", "9-3"], "--mixed: LO-HI with 1 <= LO <= HI, got '9-3'"),
    ],
)
def test_bad_flags_exit_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit):
        cli.parse_args(argv)
    assert message in capsys.readouterr().err


def test_world_size_checks():
    dist.check_world(tp=2, ep=1, world=2)
    dist.check_world(tp=2, ep=4, world=4)
    with pytest.raises(SystemExit, match="--tp 2 needs torchrun --nproc-per-node 2"):
        dist.check_world(tp=2, ep=1, world=4)
    with pytest.raises(SystemExit, match="--ep 4 --tp 1: the world size 6 must be a multiple"):
        dist.check_world(tp=1, ep=4, world=6)


def test_variants_and_batches_layout():
    check_variants(["megatron", "auto/torch/exact/varlen"])
    with pytest.raises(SystemExit, match=r"--rope: \['fast'\]"):
        check_variants(["auto", "fast"])
    with pytest.raises(SystemExit, match="--rope"):
        check_variants(["auto/auto/plan_free/auto/extra"])
    k = layer_kernels("megatron//exact")
    assert (k.rope, k.elementwise, k.attention, k.packed_attention, k.tp_overlap) == (
        "megatron", "auto", "exact", "auto", "auto",
    )  # fmt: skip
    check_variants(["auto/////graphs/symm", "auto//////ring"])  # GRAPHS, then TPO
    assert layer_kernels("auto/////graphs/symm").tp_overlap == "symm"
    for bad in ("auto//////async", "auto//////off/extra"):
        with pytest.raises(SystemExit, match="TPO in"):
            check_variants([bad])
    assert doc_lens(96, 256, torch.Generator()) == [96, 96, 64]
    lens = doc_lens("10-20", 256, torch.Generator().manual_seed(0))
    assert sum(lens) == 256 and all(10 <= n <= 20 for n in lens[:-1])
    args = SimpleNamespace(seed=5)
    assert batch_seed(32, args, rank=2) - batch_seed(32, args, rank=0) == 2 * 100003


def test_flops_and_mfu():
    seqs = [torch.arange(n) for n in (4, 3)]
    masks = [torch.arange(n) >= n // 2 for n in (4, 3)]
    batch = pack_sequences(seqs, masks)
    args = SimpleNamespace(heads=2, head_dim=8, layers=3)
    f = flops.forward_flops([batch, batch], args, decoder=100, head=10)
    attn = 2 * (4 * 5 // 2 + 3 * 4 // 2) * 2 * 2 * 2 * 8 * 3
    scored = 2 * int(batch.loss_mask.sum())
    assert (f["tokens"], f["scored_rows"], f["attention"]) == (14, scored, attn)
    assert f["total"] == 2 * 100 * 14 + 2 * 10 * 14 + attn
    assert f["total_head_scored"] == 2 * 100 * 14 + 2 * 10 * scored + attn
    s = flops.pass_stats([30.0, 10.0, 20.0], 1.5, 3, f, floor_ms=5.0, peak=2e12)
    assert (s["ms"], s["x_floor"], s["peak_gib"]) == (20.0, 4.0, 1.5)
    assert s["tokens_per_s"] == pytest.approx(14 / 0.02)
    assert s["mfu"] == pytest.approx(3 * f["total"] / 0.02 / 2e12)


def test_matmul_params_count_active_experts():
    cfg = SimpleNamespace(num_moe_experts=4, gated_linear_unit=True, hidden_size=8,
                          moe_ffn_hidden_size=3, num_layers=2, moe_router_topk=2)  # fmt: skip
    named = [
        ("decoder.layers.0.self_attention.linear_qkv.weight", torch.empty(24, 8)),
        ("decoder.layers.0.mlp.router.weight", torch.empty(4, 8)),
        ("decoder.layers.0.mlp.experts.linear_fc1.weight", torch.empty(4 * 6, 8)),
        ("decoder.layers.0.input_layernorm.weight", torch.empty(8)),
        ("embedding.word_embeddings.weight", torch.empty(50, 8)),
    ]
    gpt = SimpleNamespace(config=cfg, named_parameters=lambda: iter(named))
    decoder, head = flops.matmul_params(gpt, vocab=50)
    assert (decoder, head) == (24 * 8 + 4 * 8 + 2 * 2 * 3 * 8 * 3, 50 * 8)


def test_comparison_and_busy_time():
    def row(L, rope, lp, tr):
        return dict(L=L, rope=rope, logprob=dict(ms=lp), train=dict(ms=tr))

    rows = [row(32, "megatron", 10.0, 30.0), row(32, "auto", 5.0, 40.0), row(64, "auto", 1, 1)]
    comp = comparison(rows, ["megatron", "auto"])  # L=64 has no "before": no entry
    assert [(c["L"], c["pass_"], c["ratio"], c["speedup"]) for c in comp] == [
        (32, "logprob", 0.5, 2.0), (32, "train", 40 / 30, 30 / 40),
    ]  # fmt: skip
    assert _busy_us([(5.0, 7.0), (0.0, 2.0), (1.0, 3.0), (7.0, 8.0)]) == 6.0
    assert _busy_us([]) == 0.0
