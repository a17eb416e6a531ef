"""The trainer's two passes (``megatron_grpo/train/trainer.py``) and one timed table row of
them: the no-grad log-prob pass and megatron-core's fwd+bwd schedule with the GRPO loss."""

from __future__ import annotations

import itertools

import torch

from megatron_grpo.loss import reduce_metrics
from megatron_grpo.megatron import GRPOStep, PackedBatch, get_forward_backward_func

from .batches import batch_seed, make_batches, set_old_logprobs
from .flops import forward_flops, pass_stats
from .timing import gemm_floor, timed


class Passes:
    """The trainer's two passes over a list of micro-batches."""

    def __init__(self, step: GRPOStep, chunks: list[torch.nn.Module], merge: int, count_group=None):
        self.step, self.chunks, self.merge = step, chunks, merge or None
        self.count_group = count_group  # EP > 1: the ranks agree on the forward count

    def logprob(self, batches: list[PackedBatch]) -> list[torch.Tensor]:
        return self.step.compute_logprobs(self.chunks, batches, self.merge, self.count_group)

    def zero_grads(self) -> None:
        for c in self.chunks:
            c.zero_grad_buffer()

    def train(self, batches: list[PackedBatch]) -> list[dict]:
        self.step.prepare_update(self.chunks, batches, self.count_group)
        return get_forward_backward_func()(
            forward_step_func=self.step.forward_step,
            data_iterator=iter(batches),
            model=self.chunks[0] if len(self.chunks) == 1 else self.chunks,
            num_microbatches=len(batches),
            seq_length=max(b.num_tokens for b in batches),
            micro_batch_size=1,
            forward_only=False,
        )

    def grad_norm(self) -> float:
        """The L2 norm of the DDP gradient buffers (this rank's)."""
        grad_sq = sum(float(p.main_grad.float().pow(2).sum()) for c in self.chunks
                      for p in c.parameters() if getattr(p, "main_grad", None) is not None)  # fmt: skip
        return grad_sq**0.5


def run_row(L: int | str, impl: str, passes: Passes, gpt, args, dev, params: tuple[int, int],
            first: dict) -> dict:  # fmt: skip
    """One table row; ``first`` keeps the first impl's log-probs of each L (the same batches
    and weights: the others' max abs difference to them is ``logp_max_abs_vs_first``). A
    ``--mixed`` row times new batches in every pass (their FLOPs: those of the first ones)."""
    batches = make_batches(L, args, seed=batch_seed(L, args))
    logprobs = passes.logprob(batches)
    set_old_logprobs(batches, logprobs, seed=batch_seed(L, args) + 1)
    logp = torch.cat(logprobs)
    diff = (logp - first.setdefault(L, logp)).abs().max().item()
    flops = forward_flops(batches, args, *params)
    floor = gemm_floor(gpt, args, dev, flops["scored_rows"])  # timed now: the clock drifts
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    passes.zero_grads()
    report = reduce_metrics(passes.train(batches))  # a warm-up too; the loss of the row
    (lp_times, lp_peak), (tr_times, tr_peak) = _time_passes(L, batches, passes, args, dev)
    row = dict(L=L, rope=impl, docs_per_mb=len(batches[0].cu_seqlens) - 1,
               tokens=flops["tokens"], scored_rows=flops["scored_rows"], flops=flops,
               loss=report.get("loss/loss"), grad_norm=passes.grad_norm(),
               logp_max_abs_vs_first=diff, floor_ms=floor)  # fmt: skip
    peak = args.peak_tflops * 1e12 * args.tp_size  # MFU per GPU of the TP group
    row["logprob"] = pass_stats(lp_times, lp_peak, 1, flops, floor["logprob_ms"], peak)
    row["train"] = pass_stats(tr_times, tr_peak, 3, flops, floor["train_ms"], peak)
    return row


def _time_passes(L: int | str, batches: list[PackedBatch], passes: Passes, args, dev) -> tuple:
    """((ms list, peak GiB) of the log-prob pass, the same of fwd+bwd); a ``--mixed`` row's
    passes each get new batches (random old / ref log-probs), outside the clock."""
    box, fresh = [batches], itertools.count()

    def renew() -> None:  # --mixed: every pass sees new layouts (random old / ref log-probs)
        if isinstance(L, str):
            box[0] = make_batches(L, args, seed=batch_seed(L, args) + 7 * next(fresh) + 2)

    lp = timed(lambda: passes.logprob(box[0]), dev, args.warmup, args.iters, setup=renew)
    tr = timed(lambda: passes.train(box[0]), dev, args.warmup, args.iters,
               setup=lambda: (passes.zero_grads(), renew()))  # fmt: skip
    return lp, tr
