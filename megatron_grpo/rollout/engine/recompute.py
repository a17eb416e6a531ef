"""The reference engine: recompute the whole sequence for every new token (no KV cache).

Each step packs the unfinished sequences into one THD stream and runs the model over all of
them; only the last positions go through the LM head. Slow (quadratic), simple, and the test
oracle of the KV-cached engine: both draw by inverse CDF with the same uniform number per
(sample, response position), so they emit the same tokens up to float rounding (the oracle
always from the gathered logits, :func:`sampling.sample`; the engine at TP > 1 by default from
the vocabulary shards, ``tp_sampling``).

MoE with expert parallelism: every forward is a collective over the expert group, so each step
starts with one all-reduce MAX of (any sequence unfinished, packed length); ranks that are done
run a one-token dummy sequence until the whole group is, and under the allgather dispatcher
every rank pads its packed input to the group's longest.
"""

from __future__ import annotations

import torch

from megatron_grpo.megatron.layout import ParallelLayout
from megatron_grpo.megatron.parallel import all_reduce_max
from megatron_grpo.rollout.engine import model_io as io
from megatron_grpo.rollout.engine.params import SamplingParams
from megatron_grpo.rollout.engine.routes import RouteLog
from megatron_grpo.rollout.engine.tp_sampling import next_tokens


@torch.no_grad()
def generate_recompute(
    model: torch.nn.Module,
    prompts: list[list[int]],
    params: SamplingParams,
    uniforms: torch.Tensor,
    routes: RouteLog | None = None,
    limits: list[int | None] | None = None,
) -> tuple[list[list[int]], list[list[float]]]:
    """``uniforms [N, max_new_tokens]``: the uniform number of each (sample, position).
    ``routes`` (recording): each token's route is kept from the step that first fed it.
    ``limits``: per sample its own response limit (None: ``max_new_tokens``)."""
    caps = [params.max_new_tokens if k is None else k for k in (limits or [None] * len(prompts))]
    responses: list[list[int]] = [[] for _ in prompts]
    logprobs: list[list[float]] = [[] for _ in prompts]
    active = list(range(len(prompts)))
    # this rank's layout under the model's current sequence_parallel
    layout = ParallelLayout.current(model.config.sequence_parallel)
    group, pad = layout.expert_tp_ep_group, io.pads_expert_inputs(model)
    device, stops = io.model_device(model), params.stops
    pad_to = layout.token_multiple
    for step in range(params.max_new_tokens):
        # A finished rank of an expert-parallel group feeds a dummy token (logits unused).
        seqs = [list(prompts[i]) + responses[i] for i in active] if active else [[0]]
        num_tokens = None
        if group is not None:
            any_active, longest = all_reduce_max(
                [int(bool(active)), io.packed_length(seqs, pad_to)], group, torch.int64
            )
            if not any_active:
                break
            num_tokens = longest if pad else None
        if not active and group is None:
            break
        inputs = io.packed_inputs(seqs, pad_to, num_tokens)
        hidden = io.packed_last_hidden(model, *inputs, layout=layout)
        if routes is not None:  # step 0 feeds the prompts, later steps one new token each
            new = [0 if step == 0 else len(s) - 1 for s in seqs]
            routes.packed(active, inputs[2].cu_seqlens_q, new)
        if not active:
            continue
        u = uniforms[active, step].to(device)
        # the oracle gathers the logits: the plainest path, which the engine is tested against
        tokens, logp = next_tokens(model, hidden, u, params, layout, "gathered")
        for i, tok, lp in zip(active, tokens.tolist(), logp.tolist(), strict=True):
            responses[i].append(tok)
            logprobs[i].append(lp)
        active = [
            i for i in active if responses[i][-1] not in stops and len(responses[i]) < caps[i]
        ]
    return responses, logprobs
