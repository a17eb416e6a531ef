"""Config errors, padded vocab size, packing and the CP split layout (no process spawn)."""

from __future__ import annotations

import pytest
import torch
from megatron.core.models.common.embeddings.rope_utils import _get_thd_freqs_on_this_cp_rank

from megatron_grpo.config import ConfigError, from_dict
from megatron_grpo.megatron import (
    ModelConfig,
    ParallelConfig,
    check_parallel,
    pack_sequences,
    padded_vocab_size,
    split_for_context_parallel,
    to_transformer_config,
)
from megatron_grpo.megatron.batch.packing import padded_layout, thd_partition_index

BASE = {"vocab_size": 100, "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4}


def test_unknown_key_names_closest():
    with pytest.raises(ConfigError, match="num_attention_head.*did you mean 'num_attention_heads'"):
        from_dict(ModelConfig, {**BASE, "num_attention_head": 4})
    with pytest.raises(ConfigError, match="did you mean 'sequence_parallel'"):
        from_dict(ParallelConfig, {"sequence_paralel": True})


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"num_query_groups": 3}, "num_query_groups"),
        ({"hidden_size": 66}, "num_attention_heads"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"num_moe_experts": 2, "moe_router_topk": 3}, "moe_router_topk"),
        ({"moe_aux_loss_coeff": 0.1}, "num_moe_experts"),
        ({"rotary_percent": 1.5}, "rotary_percent"),
        ({"recompute_method": "uniform"}, "recompute_num_layers"),
    ],
)
def test_model_errors_name_the_field(data, field):
    with pytest.raises(ConfigError, match=field):
        from_dict(ModelConfig, {**BASE, **data})


def test_parallel_errors_name_the_field():
    with pytest.raises(ConfigError, match="sequence_parallel"):
        from_dict(ParallelConfig, {"sequence_parallel": True})
    with pytest.raises(ConfigError, match="tensor_model_parallel_size"):
        from_dict(ParallelConfig, {"tensor_model_parallel_size": 0})
    model = ModelConfig(**BASE)
    with pytest.raises(ValueError, match="tensor_model_parallel_size=3 must divide"):
        check_parallel(model, ParallelConfig(tensor_model_parallel_size=3), 3)
    with pytest.raises(ValueError, match="num_layers"):
        check_parallel(model, ParallelConfig(pipeline_model_parallel_size=4), 4)
    with pytest.raises(ValueError, match="expert_model_parallel_size > 1 needs"):
        check_parallel(model, ParallelConfig(expert_model_parallel_size=2), 2)
    with pytest.raises(ValueError, match="world size 3"):
        check_parallel(model, ParallelConfig(tensor_model_parallel_size=2), 3)


def test_padded_vocab_and_transformer_config():
    model = ModelConfig(**{**BASE, "make_vocab_size_divisible_by": 8})
    assert padded_vocab_size(model, 1) == 104
    assert padded_vocab_size(model, 2) == 112
    tcfg = to_transformer_config(model, ParallelConfig(tensor_model_parallel_size=2))
    assert tcfg.calculate_per_token_loss and tcfg.tensor_model_parallel_size == 2
    assert tcfg.params_dtype == torch.float32  # CPU default of params_dtype="auto"


def test_pack_sequences_alignment():
    batch = pack_sequences(
        [torch.tensor([5, 6, 7]), torch.tensor([8, 9])],
        [torch.tensor([False, True, True]), torch.tensor([False, True])],
        advantages=[1.0, -1.0],
        old_logprobs=[torch.tensor([0.0, -1.0, -2.0]), torch.tensor([0.0, -3.0])],
        pad_to_multiple_of=4,
    )
    batch.validate(vocab_size=10)
    assert batch.targets.tolist() == [6, 7, 0, 9, 0, 0, 0, 0]
    assert batch.loss_mask.tolist() == [True, True, False, True, False, False, False, False]
    assert batch.old_logprobs.tolist() == [-1.0, -2.0, 0.0, -3.0, 0.0, 0.0, 0.0, 0.0]
    assert batch.position_ids.tolist() == [0, 1, 2, 0, 1, 0, 1, 2]
    assert batch.cu_seqlens.tolist() == [0, 3, 5, 8]
    with pytest.raises(ValueError, match="old_logprobs"):
        pack_sequences([torch.tensor([1, 2])], [torch.tensor([False, True])],
                       old_logprobs=[torch.zeros(3)])  # fmt: skip


def test_cp_split_layout_matches_megatron_rope_and_round_trips():
    lens = [5, 9, 3]
    seqs = [torch.arange(n) + 10 * i for i, n in enumerate(lens)]
    batch = pack_sequences(seqs, [torch.ones(n, dtype=torch.bool) for n in lens])
    cp = 2
    cu_pad, dest = padded_layout(batch, cp)
    shards = []
    for rank in range(cp):
        local, params, index = split_for_context_parallel(batch, cp, rank)
        assert params.cu_seqlens_q_padded.tolist() == cu_pad.tolist()
        assert torch.equal(index, thd_partition_index(cu_pad, cp, rank))
        # Megatron's THD RoPE picks, per sequence, these positions for this CP rank.
        freqs = torch.arange(64.0)
        bounds = local.cu_seqlens.tolist()
        for s, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
            x = torch.empty(b - a)
            want = _get_thd_freqs_on_this_cp_rank(rank, cp, x, freqs)
            assert local.position_ids[a:b].tolist() == want.long().tolist(), f"seq {s}"
        shards.append((index, local.tokens))
    full = torch.zeros(int(cu_pad[-1]), dtype=torch.long)
    for index, tokens in shards:
        full[index] = tokens
    assert torch.equal(full[dest], batch.tokens)
