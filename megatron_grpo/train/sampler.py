"""Generation over the Megatron GPT itself: recompute per token, temperature and top-p.

Each decoding step packs the unfinished sequences into one THD stream (``cu_seqlens``; no padding,
documents never attend to each other), runs the model without a KV cache (fine for the small
models this path is meant for; large-scale users bring their own generation fleet through
``rollout.input_path``), runs only each sequence's last-position hidden state through the LM head
and all-gathers only those ``[A, V_local]`` fp32 rows across TP.

Every TP rank must emit the same tokens: all ranks hold identical gathered logits and the same
seeded generator, and the tokens of TP rank 0 are broadcast anyway so that no floating-point
nondeterminism can split the ranks. Padded vocabulary ids (``>= vocab_size``) get probability 0.

Recorded rollout log-probs: ``log softmax(logits / temperature)[token]`` over the real vocabulary,
before top-p truncation: the same distribution the training passes score with the same
temperature, so importance-sampling correction compares like with like.

MoE with expert parallelism: every forward is a collective over the expert tensor-and-model
parallel group (the ranks whose experts exchange tokens; both megatron dispatchers and the
router's no-grad path communicate only inside it). Each decode step therefore starts with one
all-reduce MAX over that group of (any sequence unfinished, packed length): ranks whose
sequences are all done keep running a one-token dummy sequence until the whole group is done,
and under the "allgather" dispatcher (CPU) every rank pads its packed input to the group's
longest (padding after the last real token, in the last document's padded bounds). The alltoall
dispatcher handles unequal lengths, so it is not padded. Dense models and EP = 1 skip the all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from torch import Tensor

from megatron_grpo.megatron.forward import hidden_states_only, output_weight
from megatron_grpo.megatron.parallel import comm_device
from megatron_grpo.ops.comm import TPInfo, all_gather_rows
from megatron_grpo.ops.lm_head import mm_f32


@dataclass(frozen=True)
class SamplingParams:
    """``max_new_tokens`` includes the eos token; ``vocab_size`` is the real vocabulary."""

    temperature: float
    top_p: float
    max_new_tokens: int
    eos_id: int
    vocab_size: int

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {self.max_new_tokens}")
        if not 0 <= self.eos_id < self.vocab_size:
            raise ValueError(
                f"eos_id {self.eos_id} is outside the vocabulary [0, {self.vocab_size})"
            )


def sample_tokens(
    logits: Tensor, params: SamplingParams, generator: torch.Generator
) -> tuple[Tensor, Tensor]:
    """Sample one token per row of full-vocabulary ``logits`` ``[A, V_padded]``.

    Returns ``(tokens [A] int64, logprobs [A] float32)``; see the module docstring for which
    log-prob is recorded.
    """
    if logits.size(-1) < params.vocab_size:
        raise ValueError(
            f"logits have {logits.size(-1)} columns, fewer than vocab_size={params.vocab_size}"
        )
    logp = torch.log_softmax(logits[:, : params.vocab_size].float() / params.temperature, dim=-1)
    probs = logp.exp()
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the most likely token always stays).
        drop = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


def _packed_length(seqs: list[list[int]], pad_to: int) -> int:
    """Packed length of ``seqs``: their total, rounded up to a multiple of ``pad_to``."""
    return -(-sum(len(s) for s in seqs) // pad_to) * pad_to


def _packed_inputs(
    seqs: list[list[int]], pad_to: int, num_tokens: int | None = None
) -> tuple[Tensor, Tensor, PackedSeqParams]:
    """``input_ids, position_ids`` ``[1, T]`` + THD params; T is ``num_tokens`` when given, else
    the total padded to a multiple of ``pad_to``. Padding lies after ``cu_seqlens_q[-1]``, inside
    the last document's padded bounds (``cu_seqlens_q_padded[-1] == T``)."""
    lens = [len(s) for s in seqs]
    total = sum(lens)
    padded = _packed_length(seqs, pad_to)
    if num_tokens is not None:
        if num_tokens < padded or num_tokens % pad_to:
            raise ValueError(
                f"num_tokens={num_tokens} must be >= {padded} and a multiple of {pad_to}"
            )
        padded = num_tokens
    ids = torch.zeros(1, padded, dtype=torch.long)
    ids[0, :total] = torch.tensor([t for s in seqs for t in s], dtype=torch.long)
    pos = torch.zeros(1, padded, dtype=torch.long)
    pos[0, :total] = torch.cat([torch.arange(n) for n in lens])
    cu = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lens).cumsum(0)
    # The padding joins the last document in the padded bounds: megatron-core's THD RoPE splits
    # the input by them and needs them to cover every token. Causal attention keeps the real
    # tokens unaffected, and the last real positions come from the unpadded bounds.
    cu_padded = cu.clone()
    cu_padded[-1] = padded
    longest = max(max(lens), lens[-1] + padded - total)
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu_padded,
        cu_seqlens_kv_padded=cu_padded,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
    )
    return ids, pos, params


def _pad_multiple(model: torch.nn.Module) -> int:
    """The packed length must be a multiple of TP under sequence parallelism."""
    sp = bool(getattr(getattr(model, "config", None), "sequence_parallel", False))
    return parallel_state.get_tensor_model_parallel_world_size() if sp else 1


def last_token_logits(
    model: torch.nn.Module, seqs: list[list[int]], num_tokens: int | None = None
) -> Tensor:
    """Full-vocabulary fp32 logits ``[A, V_padded]`` at the last position of each sequence.

    The decoder stops at its final-normed hidden states; only the A last-position rows go through
    the LM head (``[T, V]`` logits are never formed) and only those ``[A, V_local]`` rows are
    all-gathered across TP. ``num_tokens`` pads the packed input to exactly that length
    (equal lengths across the expert-parallel group under the allgather dispatcher)."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    sp = bool(getattr(getattr(model, "config", None), "sequence_parallel", False))
    ids, pos, packed = _packed_inputs(seqs, tp if sp else 1, num_tokens)
    device = next(model.parameters()).device
    ids, pos = ids.to(device), pos.to(device)
    for name in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        setattr(packed, name, getattr(packed, name).to(device))
    with hidden_states_only(model):
        hidden = model(ids, pos, None, packed_seq_params=packed).squeeze(1)  # [T_local, H]
    if sp and tp > 1:
        hidden = all_gather_rows(
            hidden, TPInfo.of(parallel_state.get_tensor_model_parallel_group())
        )
    weight = output_weight(model)
    last = hidden[packed.cu_seqlens_q[1:].long() - 1].to(weight.dtype)  # [A, H]
    local = mm_f32(last, weight.t())  # [A, V_local]
    if tp == 1:
        return local
    return tensor_parallel.gather_from_tensor_model_parallel_region(local)


def _broadcast_from_tp_src(*tensors: Tensor) -> None:
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return
    src = parallel_state.get_tensor_model_parallel_src_rank()
    group = parallel_state.get_tensor_model_parallel_group()
    device = comm_device()
    for t in tensors:
        buf = t.to(device)  # t itself when it is already there
        dist.broadcast(buf, src, group=group)
        if buf is not t:
            t.copy_(buf)


def _expert_group(model: torch.nn.Module) -> tuple[dist.ProcessGroup | None, bool]:
    """(the group whose ranks must run the same forwards or None, pad to equal lengths?)."""
    if parallel_state.get_expert_model_parallel_world_size() == 1:
        return None, False
    dispatcher = getattr(getattr(model, "config", None), "moe_token_dispatcher_type", None)
    return parallel_state.get_expert_tensor_and_model_parallel_group(), dispatcher == "allgather"


def _group_step(active: bool, length: int, group: dist.ProcessGroup) -> tuple[bool, int]:
    """One all-reduce MAX over ``group``: (is any rank still decoding, longest packed input)."""
    t = torch.tensor([int(active), length], dtype=torch.int64, device=comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t[0]), int(t[1])


def _check_layout() -> None:
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        raise ValueError(
            "the built-in sampler needs pipeline_model_parallel_size == 1; generate elsewhere "
            "and train on files (rollout.input_path)"
        )
    if parallel_state.get_context_parallel_world_size() > 1:
        raise ValueError("the built-in sampler needs context_parallel_size == 1")


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    prompts: list[list[int]],
    params: SamplingParams,
    generator: torch.Generator,
) -> tuple[list[list[int]], list[list[float]]]:
    """Sample a response for each prompt (the model is put in eval mode while sampling).

    Args:
        model: this rank's unwrapped GPTModel (vocab-parallel output, PP = CP = 1).
        prompts: token ids per sample (G copies of a prompt are simply G entries).
        generator: a CPU generator seeded identically on every TP rank of the group.
    Returns:
        ``(responses, logprobs)``: response ids (ending in ``eos_id`` unless cut at
        ``max_new_tokens``) and the recorded log-prob of each response token.
    """
    _check_layout()
    was_training = model.training
    model.eval()
    responses: list[list[int]] = [[] for _ in prompts]
    logprobs: list[list[float]] = [[] for _ in prompts]
    active = list(range(len(prompts)))
    group, pad = _expert_group(model)
    try:
        for _ in range(params.max_new_tokens):
            # A finished rank of an expert-parallel group feeds a dummy token (logits unused).
            seqs = [list(prompts[i]) + responses[i] for i in active] if active else [[0]]
            num_tokens = None
            if group is not None:
                any_active, longest = _group_step(
                    bool(active), _packed_length(seqs, _pad_multiple(model)), group
                )
                if not any_active:
                    break
                num_tokens = longest if pad else None
            if not active:
                if group is None:
                    break
                last_token_logits(model, seqs, num_tokens)
                continue
            logits = last_token_logits(model, seqs, num_tokens)
            tokens, logp = sample_tokens(logits.cpu(), params, generator)
            _broadcast_from_tp_src(tokens, logp)
            for i, tok, lp in zip(active, tokens.tolist(), logp.tolist(), strict=True):
                responses[i].append(tok)
                logprobs[i].append(lp)
            active = [i for i in active if responses[i][-1] != params.eos_id]
    finally:
        model.train(was_training)
    return responses, logprobs
