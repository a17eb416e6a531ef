"""GRPOStep inside a user's own Megatron script is safe by construction: a model config without
``calculate_per_token_loss`` or the grad-finalization hook raises naming the field, an
evaluation pass (forward_only, gradients enabled) leaves every gradient buffer at zero, and the
README's training loop (``zero_grad_buffer()`` each step) gives, step after step, the gradients
of a plain single-process autograd reference. One gloo process."""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed


def _setup():
    from megatron_grpo.loss import GRPOLossConfig
    from megatron_grpo.megatron import GRPOStep, ParallelConfig
    from tests.megatron_utils import VOCAB, build_layout, make_sequences, pack, tiny_model

    model_cfg = tiny_model()
    chunks = build_layout(ParallelConfig(), model_cfg)
    seqs = make_sequences(6, seed=3)
    batches = [pack(seqs[:3]), pack(seqs[3:])]
    return model_cfg, chunks, batches, GRPOStep(GRPOLossConfig(), vocab_size=VOCAB)


def _schedule(chunks, step, batches, forward_only: bool = False):
    from megatron_grpo.megatron import get_forward_backward_func

    return get_forward_backward_func()(
        forward_step_func=step.forward_step, data_iterator=iter(batches), model=chunks[0],
        num_microbatches=len(batches), seq_length=max(b.num_tokens for b in batches),
        micro_batch_size=1, forward_only=forward_only,
    )  # fmt: skip


def _checks_body(rank: int, world: int) -> None:
    from megatron_grpo.megatron import unwrap

    _, chunks, batches, step = _setup()
    config = unwrap(chunks[0]).config
    config.calculate_per_token_loss = False
    with pytest.raises(ValueError, match="calculate_per_token_loss must be True"):
        _schedule(chunks, step, batches)
    config.calculate_per_token_loss = True
    hook, config.finalize_model_grads_func = config.finalize_model_grads_func, None
    with pytest.raises(ValueError, match="finalize_model_grads_func is None"):
        _schedule(chunks, step, batches)
    config.finalize_model_grads_func = hook
    for c in chunks:
        c.zero_grad_buffer()
    assert torch.is_grad_enabled()
    reports = _schedule(chunks, step, batches, forward_only=True)  # an evaluation pass
    assert len(reports) == 2
    for name, p in unwrap(chunks[0]).named_parameters():
        assert p.main_grad.abs().max().item() == 0.0, name


def test_grpo_step_checks_the_model_config_and_eval_writes_no_gradients():
    run_distributed(_checks_body, 1)


def _reference_grads(ref, step, batches) -> dict[str, torch.Tensor]:
    """d(sum of loss sums / sum of counts) by plain autograd on an unwrapped model."""
    from megatron_grpo.megatron import unwrap
    from megatron_grpo.megatron.batch.transport import prepare_batch, run_model

    gpt = unwrap(ref[0])
    gpt.zero_grad(set_to_none=True)
    losses, counts = [], []
    for b in batches:
        local, params = prepare_batch(b, step.layout_of(gpt))
        hidden = run_model(ref[0], local, params)
        loss, count, _ = step.loss_func(local, gpt, hidden)
        losses.append(loss)
        counts.append(count)
    (sum(losses) / sum(counts).float()).backward()
    return {n: p.grad.detach().clone() for n, p in gpt.named_parameters()}


def _loop_body(rank: int, world: int, zero_buffers: bool) -> None:
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_grpo.megatron import ParallelConfig, build_model, cuda_compat, unwrap
    from tests.megatron_utils import assert_close

    model_cfg, chunks, batches, step = _setup()
    ref = build_model(model_cfg, ParallelConfig(), wrap_ddp=False)
    with cuda_compat():
        optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-2), chunks)
    for it in range(3):  # the README's loop, buffers zeroed each step
        unwrap(ref[0]).load_state_dict(unwrap(chunks[0]).state_dict())
        for batch, logp in zip(batches, step.compute_logprobs(chunks, batches), strict=True):
            batch.old_logprobs = logp
        want = _reference_grads(ref, step, batches)
        if zero_buffers:
            for chunk in chunks:
                chunk.zero_grad_buffer()
        optimizer.zero_grad()
        _schedule(chunks, step, batches)
        for name, p in unwrap(chunks[0]).named_parameters():
            assert_close(f"step {it}: {name}", p.main_grad, want[name])
        with cuda_compat():
            optimizer.step()


def test_readme_loop_matches_a_single_process_reference_step_after_step():
    run_distributed(_loop_body, 1, True)


def test_optimizer_zero_grad_alone_keeps_the_previous_gradient():
    """Why the README zeroes the buffers: ``optimizer.zero_grad()`` leaves ``main_grad``."""
    with pytest.raises(AssertionError, match="step 1: "):
        run_distributed(_loop_body, 1, False)


def _own_model_body(rank: int, world: int) -> None:
    """A GPTModel built by the user with the exported portable spec, set up as documented in
    "Use in your own Megatron script", trains on packed batches through GRPOStep."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig

    from megatron_grpo.megatron import cuda_compat, decoder_block_spec

    _, _, batches, step = _setup()  # parallel state (initialize_parallel) and data as above
    config = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True,
        calculate_per_token_loss=True,  # required: GRPOStep's loss is a token sum
    )  # fmt: skip
    config.finalize_model_grads_func = finalize_model_grads  # required: divides by the count
    with cuda_compat():
        gpt = GPTModel(
            config, decoder_block_spec(config, use_te=False), vocab_size=104,  # >= the data's 100 ids
            max_sequence_length=64, position_embedding_type="rope",
        )  # fmt: skip
    model = DistributedDataParallel(config, DistributedDataParallelConfig(), module=gpt)
    model.zero_grad_buffer()
    reports = _schedule([model], step, batches)
    assert len(reports) == 2
    norm = sum(p.main_grad.square().sum() for p in gpt.parameters()) ** 0.5
    assert torch.isfinite(norm) and norm > 0


def test_own_gpt_model_with_the_exported_portable_spec_trains():
    run_distributed(_own_model_body, 1)
