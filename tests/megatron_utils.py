"""Shared pieces of the Megatron integration tests (run inside spawned gloo workers; no tests
here: named test_* to stay inside the test_megatron_* files this area owns)."""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_grpo.megatron import (
    GRPOStep,
    ModelConfig,
    PackedBatch,
    ParallelConfig,
    build_model,
    destroy_parallel,
    get_forward_backward_func,
    initialize_parallel,
    pack_sequences,
    unwrap,
)

VOCAB = 100  # not divisible by TP * make_vocab_size_divisible_by: padding is exercised


def tiny_model(**kw) -> ModelConfig:
    base = dict(
        vocab_size=VOCAB,
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=128,
        make_vocab_size_divisible_by=8,
        max_sequence_length=64,
        qk_layernorm=True,
        add_qkv_bias=True,
    )
    base.update(kw)
    return ModelConfig(**base)


def make_sequences(n: int, seed: int = 0) -> list[dict]:
    """``n`` random prompt+response sequences (lengths 5..14) with rollout data."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        prompt = int(torch.randint(2, 6, (1,), generator=g))
        length = prompt + int(torch.randint(3, 9, (1,), generator=g))
        tokens = torch.randint(0, VOCAB, (length,), generator=g)
        mask = torch.arange(length) >= prompt
        out.append(
            dict(
                tokens=tokens,
                mask=mask,
                adv=float(torch.randn((), generator=g)),
                old=-torch.rand(length, generator=g) * 3 - 1,
            )
        )
    return out


def pack(seqs: list[dict], multiple: int = 1) -> PackedBatch:
    return pack_sequences(
        [s["tokens"] for s in seqs],
        [s["mask"] for s in seqs],
        advantages=[s["adv"] for s in seqs],
        old_logprobs=[s["old"] for s in seqs],
        pad_to_multiple_of=multiple,
    )


def build_layout(parallel: ParallelConfig, model_cfg: ModelConfig, seed: int = 7) -> list:
    destroy_parallel()
    initialize_parallel(parallel, seed)
    return build_model(model_cfg, parallel)


def full_params(chunks: list) -> dict[str, torch.Tensor]:
    """Parameters of a TP=1, PP=1 model by name (clones; experts one entry each)."""
    return {n: t.detach().clone() for n, _, t, _ in named_tensors(unwrap(chunks[0]))}


_STACKED = re.compile(r"(.*\.experts\.)weight([12])")


def named_tensors(gpt, grads: bool = False) -> Iterator[tuple[str, object, torch.Tensor, int]]:
    """``(name, param, tensor, partition dim)`` of every parameter (``grads``: its main_grad);
    grouped experts' stacked ``experts.weight<n> [E, ...]`` as SequentialMLP's per-expert
    ``experts.local_experts.<e>.linear_fc<n>.weight`` views, so one layout serves both."""
    for name, p in gpt.named_parameters():
        t = p.main_grad if grads else p
        match = _STACKED.fullmatch(name)
        if match is None:
            yield name, p, t, getattr(p, "partition_dim", -1)
            continue
        for e in range(t.shape[0]):
            yield (
                f"{match[1]}local_experts.{e}.linear_fc{match[2]}.weight",
                p,
                t[e],
                p.partition_dim - 1,
            )


def _glu_shard(full: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    gate, up = full.chunk(2, dim=0)
    return torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]])


def _global_name(name: str, offset: int, tied: bool = False) -> str:
    """This rank's parameter name -> the TP=1/PP=1/EP=1 name (layer and expert offsets)."""
    if tied and name == "output_layer.weight":
        return "embedding.word_embeddings.weight"
    parts = name.split(".")
    if name.startswith("decoder.layers."):
        parts[2] = str(int(parts[2]) + offset)
    if "local_experts" in parts:
        i = parts.index("local_experts") + 1
        ep_rank = parallel_state.get_expert_model_parallel_rank()
        parts[i] = str(int(parts[i]) + ep_rank * _NUM_LOCAL_EXPERTS[0])
    return ".".join(parts)


_NUM_LOCAL_EXPERTS = [1]


def _prepare_names(gpt, model_cfg: ModelConfig) -> tuple[int, bool]:
    if model_cfg.num_moe_experts:
        ep = parallel_state.get_expert_model_parallel_world_size()
        _NUM_LOCAL_EXPERTS[0] = model_cfg.num_moe_experts // ep
    offset = gpt.decoder.layers[0].layer_number - 1 if len(gpt.decoder.layers) else 0
    return offset, model_cfg.share_embeddings_and_output_weights


def _tp_of(name: str) -> tuple[int, int, object]:
    """(size, rank, group) of the TP dimension parameter ``name`` is sharded over: expert-TP
    for routed experts (``parallel.expert_tensor_parallel_size``), else TP."""
    ps = parallel_state
    if ".experts." in name:
        return (
            ps.get_expert_tensor_parallel_world_size(),
            ps.get_expert_tensor_parallel_rank(),
            ps.get_expert_tensor_parallel_group(),
        )
    return (
        ps.get_tensor_model_parallel_world_size(),
        ps.get_tensor_model_parallel_rank(),
        ps.get_tensor_model_parallel_group(),
    )


def load_full(chunks: list, full: dict[str, torch.Tensor], model_cfg: ModelConfig) -> None:
    """Copy TP=1 weights into this rank's TP/PP shard (real vocab rows only; padding 0)."""
    gpt = unwrap(chunks[0])
    offset, tied = _prepare_names(gpt, model_cfg)
    with torch.no_grad():
        for name, param, p, dim in named_tensors(gpt):
            tp, rank, _ = _tp_of(name)
            src = full[_global_name(name, offset, tied)]
            if name.endswith("word_embeddings.weight") or name.endswith("output_layer.weight"):
                rows = torch.zeros(p.shape[0] * tp, p.shape[1])
                rows[:VOCAB] = src[:VOCAB]
                src = rows.chunk(tp)[rank]
            elif getattr(param, "tensor_model_parallel", False) and tp > 1:
                glu = name.endswith("linear_fc1.weight") and model_cfg.gated_linear_unit
                src = _glu_shard(src, rank, tp) if glu else src.chunk(tp, dim=dim)[rank]
            p.copy_(src)


def gather_full_grads(chunks: list, model_cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """main_grad of every parameter, un-sharded over TP (same layout as :func:`full_params`),
    on the ranks that hold it (PP: only this stage's layers, by global name)."""
    gpt = unwrap(chunks[0])
    offset, tied = _prepare_names(gpt, model_cfg)
    out = {}
    for name, p, grad, dim in named_tensors(gpt, grads=True):
        tp, _, group = _tp_of(name)
        g = grad.detach().clone()
        if getattr(p, "tensor_model_parallel", False) and tp > 1:
            parts = [torch.empty_like(g) for _ in range(tp)]
            dist.all_gather(parts, g, group=group)
            glu = name.endswith("linear_fc1.weight") and model_cfg.gated_linear_unit
            if glu:
                halves = [x.chunk(2) for x in parts]
                g = torch.cat(
                    [torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])]
                )
            else:
                g = torch.cat(parts, dim=dim)
        if name.endswith("word_embeddings.weight") or name.endswith("output_layer.weight"):
            g = g[:VOCAB]
        out[_global_name(name, offset, tied)] = g
    return out


def train_grads(chunks: list, step: GRPOStep, batches: list[PackedBatch]):
    """One forward/backward over ``batches`` (micro-batches) -> (grads by name, report)."""
    for c in chunks:
        c.zero_grad_buffer()
    reports = get_forward_backward_func()(
        forward_step_func=step.forward_step,
        data_iterator=iter(batches),
        model=chunks[0] if len(chunks) == 1 else chunks,
        num_microbatches=len(batches),
        seq_length=max(b.num_tokens for b in batches),
        micro_batch_size=1,
        forward_only=False,
    )
    return reports


def assert_close(name: str, got: torch.Tensor, want: torch.Tensor, tol: float = 2e-5) -> None:
    err = (got - want).abs().max().item()
    scale = want.abs().max().item() + 1e-12
    assert err <= tol * max(1.0, scale), f"{name}: max abs err {err:.3e} (scale {scale:.3e})"
