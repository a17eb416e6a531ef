"""How large the micro-batches of the no-grad log-prob passes and the update are, from a recipe:
the merge size ``training.logprob_max_tokens_per_micro_batch`` resolves to, the tokens a pass's
micro-batch holds at most, and the MoE layouts under which merging is refused. A mixin of
:class:`~megatron_grpo.train.config.TrainConfig` (its ``model``, ``parallel``, ``training``
and ``rollout`` sections); as light to import as the config."""

from __future__ import annotations

from megatron_grpo.megatron.config import dispatcher_type

# logprob_max_tokens_per_micro_batch "auto": on one H200 the no-grad pass of a 0.6B model runs at
# 0.45-0.50 MFU at 32k tokens, 0.23-0.42 at 8k (bench_train_passes.py); 32k activations stay small
LOGPROB_MERGE_TOKENS = 32768
MERGE_NEEDS_ALLTOALL = (
    "training.logprob_max_tokens_per_micro_batch needs model.moe_token_dispatcher_type "
    "alltoall (the GPU default) and model.layer_kernels.moe_dispatch auto or alltoall at "
    "parallel.expert_model_parallel_size > 1 (unless it divides tensor_model_parallel_size with "
    "expert_tensor_parallel_size 1): the allgather and gathered dispatches need the same token "
    "count in each forward on every expert-parallel rank, which merged micro-batches do not "
    "keep; set it to null"
)


class LogprobPassSizes:
    """The log-prob passes' sizes of a :class:`~megatron_grpo.train.config.TrainConfig`."""

    @property
    def logprob_merge_tokens(self) -> int | None:
        """What the log-prob passes merge micro-batches up to (None: they don't), with
        ``training.logprob_max_tokens_per_micro_batch`` "auto" resolved for this model."""
        merge = self.training.logprob_max_tokens_per_micro_batch
        equal_tokens = self.moe_forwards_need_equal_tokens(dispatcher_type(self.model))
        if merge == "auto":
            return None if equal_tokens else LOGPROB_MERGE_TOKENS
        if merge is not None and equal_tokens:  # the CPU default dispatcher (allgather)
            raise ValueError(MERGE_NEEDS_ALLTOALL)
        return merge

    @property
    def logprob_pass_tokens(self) -> int:
        """The most tokens a micro-batch of the log-prob passes holds: the merge size, else the
        update's micro-batch (its token bound, or its samples at the longest rollout)."""
        return self.logprob_merge_tokens or self.update_pass_tokens

    @property
    def update_pass_tokens(self) -> int:
        """The most tokens an update micro-batch holds: its token bound, or its samples at the
        longest rollout."""
        t, r = self.training, self.rollout
        bound = t.max_tokens_per_micro_batch
        return bound or t.micro_batch_size * (r.max_prompt_length + r.max_response_length)

    def moe_forwards_need_equal_tokens(self, dispatcher: str | None) -> bool:
        """Whether every MoE forward is a collective over ranks with different batches (EP)
        that needs the same token count on each: megatron-core's allgather ``dispatcher``, or
        the gathered dispatch chosen for every forward (``model.layer_kernels.moe_dispatch:
        gathered``; its all-gather takes equal shares). The trainer then pads each rank's
        ``i``-th micro-batch to the group's longest, and merged log-prob micro-batches would
        differ. Under all-to-all the ranks only agree on the number of forwards
        (``GRPOStep.compute_logprobs(count_group=...)``); an expert group inside a TP group
        (:meth:`expert_group_shares_batches`, e.g. TP 2 + SP, EP 2) has equal tokens anyway."""
        moe = self.model.num_moe_experts is not None
        if not moe or self.parallel.expert_model_parallel_size == 1:
            return False
        if self.expert_group_shares_batches():
            return False
        return dispatcher == "allgather" or self.model.layer_kernels.moe_dispatch == "gathered"

    def expert_group_shares_batches(self) -> bool:
        """Whether each expert-parallel group lies in one TP group (same micro-batches): with
        expert-TP 1 megatron-core's EP groups are runs of consecutive ranks, as TP groups are."""
        par = self.parallel
        tp, etp = par.tensor_model_parallel_size, par.expert_tensor_parallel_size
        return (etp or tp) == 1 and tp % par.expert_model_parallel_size == 0
