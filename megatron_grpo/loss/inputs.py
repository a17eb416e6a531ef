"""``LossInputs``: the policy-independent inputs of one packed micro-batch's GRPO loss.

One frozen value for what ``build_context``, ``grpo_loss`` and ``ops.fused_grpo_loss`` all take
besides the current log-probs: per-token ``[T]`` tensors, the sequence boundaries, the
aggregation denominator and the CP group. Values are checked where they are used
(``loss.math.build_context``: one host sync for all checks), not here.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_grpo.loss.segments import host_to_device


@dataclass(frozen=True, kw_only=True)
class LossInputs:
    """The loss inputs of one packed micro-batch (see :func:`megatron_grpo.loss.grpo_loss`).

    Attributes:
        old_logprobs: ``[T]`` log-probs of the policy that produced the batch; None =
            on-policy (the current log-probs, detached). Required, so it is never left out
            by accident.
        advantages: ``[T]`` per-token advantages.
        loss_mask: ``[T]`` bool, True at tokens that enter the loss.
        cu_seqlens: ``[S+1]`` sequence boundaries (0, ..., T); may stay on the host.
        ref_logprobs: ``[T]`` reference-policy log-probs (KL), or None.
        rollout_logprobs: ``[T]`` generation-engine log-probs (IS correction), or None.
        denominator: the ``loss_agg`` count over the optimizer step; None = this
            micro-batch's (over CP); Megatron's per-token-loss path passes 1.0.
        cp_group: the context-parallel group when sequences are split over CP ranks.
    """

    old_logprobs: Tensor | None
    advantages: Tensor
    loss_mask: Tensor
    cu_seqlens: Tensor
    ref_logprobs: Tensor | None = None
    rollout_logprobs: Tensor | None = None
    denominator: float | Tensor | None = None
    cp_group: dist.ProcessGroup | None = None

    @staticmethod
    def of(inputs: LossInputs | None = None, **overrides: object) -> LossInputs:
        """``inputs`` with the keyword ``overrides`` applied (``inputs`` None: built from
        them): the keyword forms of the public functions. An unknown name raises TypeError."""
        if inputs is None:
            return LossInputs(**overrides)
        return replace(inputs, **overrides) if overrides else inputs

    @staticmethod
    def field_names() -> frozenset[str]:
        """The input names (what the keyword forms accept)."""
        return frozenset(f.name for f in fields(LossInputs))

    @staticmethod
    def from_batch(
        batch: object,
        *,
        device: torch.device | None = None,
        denominator: float | Tensor | None = None,
        cp_group: dist.ProcessGroup | None = None,
    ) -> LossInputs:
        """The inputs read from a packed batch by attribute name (``old_logprobs``,
        ``advantages``, ``loss_mask``, ``cu_seqlens``, ``ref_logprobs``, ``rollout_logprobs``:
        e.g. a ``megatron.PackedBatch``), the tensors moved to ``device`` (None: left where
        they are). ``cu_seqlens`` stays where it is: the loss checks it on the host for free
        and moves it itself. A batch without ``advantages`` is an error naming the field."""
        name = type(batch).__name__
        if getattr(batch, "advantages", None) is None:
            raise ValueError(f"{name}.advantages is required for the GRPO loss")

        def moved(value: Tensor | None) -> Tensor | None:
            return value if value is None or device is None else host_to_device(value, device)

        return LossInputs(
            old_logprobs=moved(batch.old_logprobs),
            advantages=moved(batch.advantages),
            loss_mask=moved(batch.loss_mask),
            cu_seqlens=batch.cu_seqlens,
            ref_logprobs=moved(batch.ref_logprobs),
            rollout_logprobs=moved(batch.rollout_logprobs),
            denominator=denominator,
            cp_group=cp_group,
        )
