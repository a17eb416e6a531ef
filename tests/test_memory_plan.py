"""memory_plan: exact parameter counts (vs. models built with build_model on CPU), how the plan
responds to TP / SP / PP / distributed optimizer / recompute / EP, the log-prob working sets
(against the ops' tiling and path rule, and H200 measurements), the rank layout arithmetic and
the layout checks of dry_run."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from megatron.core import parallel_state

from megatron_grpo.loss import GRPOLossConfig
from megatron_grpo.megatron import ModelConfig, ParallelConfig, unwrap
from megatron_grpo.megatron.plan.memory import (
    GIB,
    ROW_BYTES,
    format_plan,
    lm_head_plan,
    loss_working_set,
    memory_plan,
    stage_params,
)
from megatron_grpo.ops import fused_grpo_loss
from megatron_grpo.ops.lm_head.options import LMHeadOptions
from megatron_grpo.ops.lm_head.plan import DEFAULT_MEMORY_BUDGET, TILE_FRACTION
from megatron_grpo.ops.lm_head.reference import STATS_BLOCK
from megatron_grpo.ops.lm_head.tiling import TILE_BYTES, Tiling
from megatron_grpo.train.dry_run import (
    check_layout,
    format_layout,
    orthogonal_groups,
    rank_layout,
)
from tests.dist_utils import run_distributed
from tests.megatron_utils import build_layout, tiny_model

P = ParallelConfig


def _variants() -> list[tuple[ModelConfig, ParallelConfig]]:
    dense = tiny_model()  # RMSNorm, GLU, qk norms, qkv bias, untied
    other = tiny_model(
        normalization="LayerNorm", add_bias_linear=True, gated_linear_unit=False,
        activation_func="gelu", position_embedding_type="learned_absolute",
        share_embeddings_and_output_weights=True, qk_layernorm=False, add_qkv_bias=False,
    )  # fmt: skip
    moe = tiny_model(
        num_layers=4, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
        moe_layer_freq=2, moe_shared_expert_intermediate_size=48, moe_shared_expert_gate=True,
    )  # fmt: skip
    return [
        (dense, P()),
        (other, P()),
        (moe, P()),
        (moe, P(expert_model_parallel_size=2)),
        (dense, P(tensor_model_parallel_size=2, sequence_parallel=True)),
        (
            moe,
            P(
                tensor_model_parallel_size=2,
                sequence_parallel=True,
                expert_model_parallel_size=2,
                expert_tensor_parallel_size=1,
            ),
        ),  # fmt: skip
        (other, P(pipeline_model_parallel_size=2)),  # tied: the last stage keeps a copy
        (dense, P(pipeline_model_parallel_size=2)),
    ]


def _count_body(rank: int, world: int) -> None:
    for model_cfg, par in _variants():
        chunks = build_layout(par, model_cfg)
        named = [(n, p.numel()) for c in chunks for n, p in unwrap(c).named_parameters()]
        expert = sum(k for n, k in named if ".experts." in n)  # routed experts, not shared
        dense = sum(k for _, k in named) - expert
        stage = parallel_state.get_pipeline_model_parallel_rank()
        want = stage_params(model_cfg, par, stage)
        assert (dense, expert) == want, f"{model_cfg} {par} stage {stage}: {(dense, expert)}"


@pytest.mark.slow
def test_parameter_counts_match_built_models():
    run_distributed(_count_body, 2)


QWEN3_8B = ModelConfig(
    vocab_size=151936, num_layers=36, hidden_size=4096, num_attention_heads=32,
    num_query_groups=8, ffn_hidden_size=12288, qk_layernorm=True, max_sequence_length=40960,
)  # fmt: skip
MOE = ModelConfig(
    vocab_size=151936, num_layers=8, hidden_size=2048, num_attention_heads=32,
    num_query_groups=4, kv_channels=128, num_moe_experts=16, moe_router_topk=4,
    moe_ffn_hidden_size=768,
)  # fmt: skip


def _plan(model=QWEN3_8B, par=None, **kw):
    args = dict(micro_batch_tokens=32768, use_distributed_optimizer=False, dp_size=8)
    return memory_plan(model, par or P(), **{**args, **kw})


def test_qwen3_8b_parameter_count():
    dense, expert = stage_params(QWEN3_8B, P(), 0)
    assert expert == 0 and 8.18e9 < dense < 8.20e9  # Qwen3-8B: 8.19B with untied embeddings


def test_tp_and_sequence_parallel_divide_activations():
    act = _plan().stages[0].bytes["activations"]
    sp = _plan(par=P(tensor_model_parallel_size=4, sequence_parallel=True))
    no_sp = _plan(par=P(tensor_model_parallel_size=4))
    assert sp.stages[0].bytes["activations"] == pytest.approx(act / 4)
    assert act / 4 < no_sp.stages[0].bytes["activations"] < act
    assert sp.stages[0].params < _plan().stages[0].params / 3.9


def test_distributed_optimizer_shards_over_dp_and_cp():
    base = _plan().stages[0].bytes
    dist = _plan(use_distributed_optimizer=True, dp_size=8).stages[0].bytes
    assert dist["optimizer"] == pytest.approx(base["optimizer"] / 8)
    assert dist["grads"] == base["grads"] and dist["params"] == base["params"]
    assert base["optimizer"] == 12 * _plan().stages[0].params  # fp32 m, v, master
    fp32 = _plan(params_dtype="float32").stages[0]
    assert fp32.bytes["optimizer"] == 8 * fp32.params and fp32.bytes["params"] == 4 * fp32.params


def test_pipeline_stages_split_params_and_hold_in_flight_micro_batches():
    one = _plan().stages[0]
    two = _plan(par=P(pipeline_model_parallel_size=2)).stages
    assert two[0].params + two[1].params == one.params  # untied: nothing duplicated
    assert (two[0].in_flight, two[1].in_flight) == (2.0, 1.0)
    assert two[0].bytes["activations"] == pytest.approx(one.bytes["activations"])
    assert two[0].bytes["logprobs"] == 0 < two[1].bytes["logprobs"]
    vpp = P(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    assert _plan(par=vpp).stages[0].in_flight == 2.5  # Megatron's interleaved warm-up: 4 + 1


def test_full_recompute_keeps_layer_inputs():
    model = replace(
        QWEN3_8B, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
    )
    plan = _plan(model=model, par=P(tensor_model_parallel_size=4, sequence_parallel=True))
    per_layer = _plan(par=P(tensor_model_parallel_size=4, sequence_parallel=True))
    per_layer = per_layer.stages[0].bytes["activations"] / 36
    layer_input = 32768 / 4 * 4096 * 2
    assert plan.stages[0].bytes["activations"] == pytest.approx(36 * layer_input + per_layer)


def test_expert_parallel_divides_expert_params():
    one = _plan(model=MOE).stages[0]
    ep = _plan(model=MOE, par=P(expert_model_parallel_size=4)).stages[0]
    assert one.expert_params == 4 * ep.expert_params > 0
    assert one.dense_params == ep.dense_params


def test_megatron_logits_working_set_is_larger():
    plan = _plan(par=P(tensor_model_parallel_size=4, sequence_parallel=True))
    ours, theirs = plan.loss_paths["fused"], plan.loss_paths["megatron"]
    op = plan.loss_paths["op"]
    assert theirs.logits >= 4 * ours.logits
    assert 0 < ours.logits <= DEFAULT_MEMORY_BUDGET  # the single pass's chunk
    assert 0 < op.logits <= TILE_BYTES  # one logits tile of the op's tiled passes
    v_local = 152064 // 4  # 151936 padded to a multiple of 128 * TP
    assert theirs.logits == 32768 * v_local * 6  # bf16 logits + fp32 softmax
    text = format_plan(plan)
    assert "megatron" in text and "pp0" in text


# Measured on one H200 (tools/bench_logprobs.py, H=4096, V=151936, bf16, default tiles): peak
# memory beyond the bf16 gradients of vocab_parallel_logprobs forward + backward, in GiB, keyed
# by (T, main_grad bytes: 4 = an fp32 main_grad allocated up front, None = bf16 weight.grad).
H200_OVER_GRADS_GIB = {(8192, 4): 0.38, (32768, 4): 0.42, (8192, None): 0.38,
                       (32768, None): 0.92}  # fmt: skip
# Same measurement for fused_grpo_loss: its fused-epilogue single pass with an fp32 main_grad
# (3200-row chunks of bf16 shifted logits), its tiled path without (the split accumulator's
# 1344-row chunks are below SPLIT_MIN_ROWS; re-measured 2026-11-23, third session).
H200_FUSED_OVER_GRADS_GIB = {(8192, 4): 0.96, (32768, 4): 0.96, (8192, None): 0.38,
                             (32768, None): 0.92}  # fmt: skip


def _ws(path, tokens, v_local=151936, hidden=4096, tp=1, sp=False, main_grad_bytes=4, **kw):
    return loss_working_set(
        path, tokens=tokens, hidden=hidden, v_local=v_local, param_bytes=2, sp=sp, tp=tp,
        main_grad_bytes=main_grad_bytes, **kw,
    )  # fmt: skip


@pytest.mark.parametrize(
    "path,measured", [("op", H200_OVER_GRADS_GIB), ("fused", H200_FUSED_OVER_GRADS_GIB)]
)
def test_working_set_predicts_h200_measurements(path, measured):
    for (tokens, main_grad), gib in measured.items():
        predicted = _ws(path, tokens, main_grad_bytes=main_grad).total / GIB
        assert predicted == pytest.approx(gib, rel=0.15), (tokens, main_grad, predicted)


@pytest.mark.parametrize("tokens", [100, 8192, 20000])
@pytest.mark.parametrize("v_local", [151936, 37984])
def test_op_working_set_follows_the_tiling(tokens, v_local):
    """One tile of Tiling.plan in the plan's tile dtype (fp32 logits, or bf16 d logits with the
    fused epilogue); rows outer with an fp32 main_grad (an fp32 [R, H] d_hidden block), vocab
    outer without (fp32 [T, H] d_hidden + a [Vc, H] d_weight tile if several row blocks); fp32
    [T, H] d_hidden under TP; the gathered [T, H] hidden under SP."""
    h = 64
    plan = lm_head_plan("op", tokens=tokens, hidden=h, v_local=v_local, param_bytes=2)
    tiling = Tiling.plan(tokens, v_local, None, TILE_BYTES, plan.tile_dtype)
    assert tiling == plan.tiling()
    elem = plan.tile_dtype.itemsize
    rows, blocks = min(tiling.rows, tokens), len(tiling.row_blocks())
    direct = _ws("op", tokens, v_local, h)
    outer = _ws("op", tokens, v_local, h, main_grad_bytes=None)
    assert direct.logits == outer.logits == rows * tiling.cols * elem <= TILE_BYTES
    d_weight_tile = tiling.cols * h * 4 if blocks > 1 else 0
    assert outer.other - direct.other == tokens * h * 4 + d_weight_tile - rows * h * 4
    assert _ws("op", tokens, v_local, h, main_grad_bytes=2) == outer  # bf16 main_grad: same
    tp = _ws("op", tokens, v_local, h, tp=4)
    sp = _ws("op", tokens, v_local, h, tp=4, sp=True)
    assert tp.other - direct.other == tokens * h * 4
    assert sp.other - tp.other == tokens * h * 2


def test_fused_working_set_follows_the_single_pass_rule():
    """The fused path's buffers are the single pass's exactly where the plan picks it
    (full-width chunk in the plan's tile dtype, the chunk's fp32 [C, H] d_hidden and block
    statistics, the int8 [V_local, H] d_weight residual when there is no fp32 main_grad), else
    the op's tiled passes; within the memory budget either way."""
    seen = set()  # the int8 residual of a 152k x 16384 shard exceeds the budget: tiled
    for h, v_local in [(4096, 4096), (4096, 16384), (4096, 37984), (4096, 151936), (16384, 151936)]:
        for tokens in (1000, 4096, 32768):
            for main_grad in (4, None):
                fused = _ws("fused", tokens, v_local, h, main_grad_bytes=main_grad)
                op = _ws("op", tokens, v_local, h, main_grad_bytes=main_grad)
                plan = lm_head_plan("fused", tokens=tokens, hidden=h, v_local=v_local,
                                    param_bytes=2, main_grad_bytes=main_grad)  # fmt: skip
                seen.add(plan.chunk_rows is None)
                if plan.chunk_rows is None:
                    assert fused == replace(op, path="fused")
                    continue
                chunk = min(plan.chunk_rows, tokens)
                assert fused.logits == chunk * v_local * plan.tile_dtype.itemsize
                acc = 0 if main_grad == 4 else v_local * h  # the int8 residual
                stats = chunk * -(-v_local // STATS_BLOCK) * 16
                assert fused.other == chunk * h * 4 + stats + acc + ROW_BYTES * tokens
                assert fused.total - ROW_BYTES * tokens <= DEFAULT_MEMORY_BUDGET
    assert seen == {True, False}  # both paths occur on this grid


def test_plan_predicts_the_path_fused_grpo_loss_takes():
    """At a tiny CPU shape, with the tile budget set so that each rule branch occurs, the path
    the plan models is the one fused_grpo_loss runs (its autograd Function)."""
    t, h, v = 16, 64, 32
    cases = {  # (main_grad bytes, tile budget) -> path
        (4, 4 * v * t): "Single",
        (None, v * t): "Tiled",  # the int8 [V, H] d_weight residual exceeds one tile
        (None, 4 * v * h): "Single",
        (4, 4 * v * t // 2): "Tiled",  # a full-width chunk of all rows does not fit
    }
    for (main_grad, tile), want in cases.items():
        budget = TILE_FRACTION * tile
        weight = (0.1 * torch.randn(v, h)).bfloat16().requires_grad_()
        if main_grad:
            weight.main_grad = torch.zeros(v, h)
        hidden = torch.randn(t, h).bfloat16().requires_grad_()
        loss, _, _ = fused_grpo_loss(
            hidden, weight, torch.randint(0, v, (t,)), GRPOLossConfig(),
            old_logprobs=torch.full((t,), -3.0), advantages=torch.ones(t),
            loss_mask=torch.ones(t, dtype=torch.bool), cu_seqlens=torch.tensor([0, t]),
            impl="torch", memory_budget=budget,
        )  # fmt: skip
        assert type(loss.grad_fn).__name__.startswith(f"_{want}")
        opts = LMHeadOptions(memory_budget=budget)
        fused = _ws("fused", t, v, h, main_grad_bytes=main_grad, options=opts)
        op = _ws("op", t, v, h, main_grad_bytes=main_grad, options=opts)
        tiled = replace(op, path="fused")
        assert (fused != tiled) == (want == "Single"), (main_grad, budget, fused)


def test_rank_layout_arithmetic():
    groups = orthogonal_groups([2, 1, 1, 2, 2], [True, False, False, False, False])
    assert groups == [[0, 1], [2, 3], [4, 5], [6, 7]]
    lay = rank_layout(P(tensor_model_parallel_size=2, pipeline_model_parallel_size=2), 8)
    assert lay.groups["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lay.groups["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert lay.verified.startswith("match")
    par = P(
        tensor_model_parallel_size=2,
        context_parallel_size=2,
        pipeline_model_parallel_size=2,
        expert_model_parallel_size=4,
        expert_tensor_parallel_size=1,
        sequence_parallel=True,
    )
    lay = rank_layout(par, 32)
    assert lay.sizes == dict(tp=2, cp=2, pp=2, dp=4, ep=4, etp=1, edp=4)
    assert lay.groups["ep"][0] == [0, 1, 2, 3] and lay.groups["cp"][0] == [0, 2]
    assert lay.verified.startswith("match"), lay.verified
    assert "ep" in format_layout(lay)


def test_check_layout_errors_name_fields():
    with pytest.raises(ValueError, match="world size 12"):
        check_layout(QWEN3_8B, P(tensor_model_parallel_size=8), 12)
    with pytest.raises(ValueError, match="sequence_parallel"):
        check_layout(MOE, P(tensor_model_parallel_size=2), 8)
    with pytest.raises(ValueError, match="expert_model"):
        check_layout(MOE, P(expert_model_parallel_size=8), 4)  # EP does not fit the world
    with pytest.raises(ValueError, match="world_size"):
        check_layout(QWEN3_8B, P(), 0)
    assert check_layout(QWEN3_8B, P(tensor_model_parallel_size=4), 64) == 16


def test_plan_rejects_bad_arguments():
    with pytest.raises(ValueError, match="path must be one of"):
        _plan(lm_head=LMHeadOptions(path="liger"))
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        _plan(micro_batch_tokens=0)
    assert isinstance(_plan().params_dtype, torch.dtype)
