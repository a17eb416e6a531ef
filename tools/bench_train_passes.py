"""Benchmark: the training passes of the trainer on packed micro-batches, per document length.

Per document length L (``--doc-lens``) and packed-RoPE implementation (``--rope``), on one GPU
(Qwen3-0.6B shape by default, random weights, bf16, TP=1, the portable layer spec)::

    python tools/bench_train_passes.py --rope megatron,auto --out $OUT        # before / after
    python tools/bench_train_passes.py --rope megatron,auto --doc-lens 8192 --profile \\
        --profile-len 8192 --out $OUT                                         # kernel tables

(On the lent GPU machine first ``. tools/gpu_env.sh; WHEELS=wheels install_carried`` with
wheels/ carried. The first command took about 4 minutes on an H100: megatron-core's RoPE loop
at L=32 alone costs ~18 s per fwd+bwd pass.)

Expert parallelism (``--moe --ep N``, one process per GPU under torchrun; expert-TP 1, every
rank its own micro-batches as data-parallel ranks have; MFU per GPU from the rank's active
FLOPs; rank 0 prints and writes)::

    torchrun --nproc-per-node 4 tools/bench_train_passes.py --moe --ep 4 --out $OUT
    torchrun --nproc-per-node 4 tools/bench_train_passes.py --moe --ep 4 --mixed 100-4000 \
        --profile --profile-len 8192 --out $OUT        # kernel tables (a trace per rank)

CPU dry run of the same logic (tiny model; run by tests/test_tools.py)::

    python tools/bench_train_passes.py --device cpu --tiny --rope megatron,auto

The passes are the trainer's own calls (``megatron_grpo/train/trainer.py``):

* log-prob: ``GRPOStep.compute_logprobs(chunks, micro_batches, max_tokens)``, the no-grad pass
  of the old and reference log-probs (megatron-core's forward-only schedule, results copied to
  the host), over micro-batches merged up to ``--logprob-merge`` tokens as the trainer's
  default merges them (``0``: one forward per micro-batch);
* fwd+bwd: megatron-core's ``forward_backward_func`` with ``GRPOStep.forward_step`` over the
  micro-batches (``forward_only=False``), as ``Trainer._forward_backward``: the GRPO loss, the
  backward into the DDP gradient buffers and the schedule's ``finalize_model_grads``. No
  optimizer step (the gradient buffers are zeroed before each iteration, outside the timing).

Every micro-batch is ``--tokens`` packed tokens: documents of L tokens (one shorter document
takes the rest when L does not divide it), prompt = the first half, response (loss mask) = the
second; advantages random per document, old log-probs = the log-prob pass's output (as the
trainer sets them), reference log-probs = old + noise (``--kl-coef`` uses them).

``--mixed LO-HI`` adds a row of documents with lengths uniform in [LO, HI], new ones in every
micro-batch of every timed pass, as a trainer meets them (each pass brings the attention new
bucket shapes; FLOPs and MFU are those of the first batches).

``--rope`` (a comma list of ``ROPE[/LAYER[/BUCKETS[/ATTN[/QK[/GRAPHS[/TPO]]]]]]``) is the
model's ``ModelConfig.layer_kernels`` (``LayerKernels(rope=ROPE, elementwise=LAYER,
attention=BUCKETS, packed_attention=ATTN, qk_norm_rope=QK, tp_overlap=TPO)``, what a recipe's
``model.layer_kernels`` sets): each variant is a model of its own, built with it and loaded with the first one's weights (GPU memory: one model per
variant), the rows of one L back to back: "megatron" is
megatron-core's per-document loop (the "before"), "auto" / "torch" / "triton" our packed RoPE;
BUCKETS "exact" runs mixed-length documents on torch's SDPA choice (cuDNN on Hopper, a plan
per new shape), the default "plan_free" on flash / memory-efficient. ATTN is the packed
attention path (auto, varlen, blocked, buckets; default auto), e.g.
``auto/auto/plan_free/buckets,auto/auto/plan_free/varlen`` for the length-bucketed SDPA against
one varlen_attn call per layer (issue 42); QK "separate" against "fused" times the q / k norms
and RoPE as four ops against one (``ops.layers.qk_norm_rope``); GRAPHS "eager" against
"graphs" runs the log-prob and fwd+bwd passes without and with CUDA graphs
(``training.logprob_cuda_graphs`` and ``training.update_cuda_graphs``; default auto: on where
they run and host-bound), e.g. ``auto/////eager,auto/////graphs``; TPO "off" against "ring" or
"symm" times the SP linear layers' collectives overlapped with their GEMMs at ``--tp`` > 1
(``model.layer_kernels.tp_overlap``), e.g. ``auto//////off,auto//////symm``. The comparison
table gives
each variant's time over the first one's (after / before; < 1 is faster).

Timing: ``--warmup`` iterations, then the median of ``--iters``, each between
``synchronize`` + ``perf_counter``. Tokens/s counts all packed tokens (prompt too). MFU = model
FLOPs / (time * ``--peak-tflops``): forward 2 * N per token, N = the decoder's matmul weights +
the LM head (vocab x hidden, counted on every token), plus causal attention 2 * 2 * heads *
head_dim * L (L + 1) / 2 per document and layer; fwd+bwd = 3x forward. (The trainer's LM head
only runs on loss-mask rows: ``mfu_head_scored`` in the JSON counts the head there only.)
"x floor" = time over the GEMM floor: cuBLAS alone on the pass's dense GEMMs (each layer's
linear layers on T tokens, the LM head on the loss-mask rows; fwd+bwd: fwd, d input and
d weight), timed on random tensors of the model's dtype right before each row. Peak memory:
``torch.cuda.max_memory_allocated`` over the timed iterations of each pass (reset before it;
includes the weights, fp32 gradient buffers and inputs).

``--dense8b``: Qwen3-8B's layer shape (4 layers of hidden 4096, FFN 12288, heads 32/8 x 128,
vocab 151936, untied). ``--tp N``: tensor parallelism N (sequence parallel on for N > 1) under
``torchrun --nproc-per-node N`` (data-parallel size 1); MFU is per GPU (model FLOPs / (time * N
* peak)). ``--tp 1,2,4`` without torchrun runs each size under its own torchrun in turn and
prints their MFU side by side (tools/bench_tp.py), e.g. on 4 GPUs::

    python tools/bench_train_passes.py --dense8b --tp 1,2,4 --tokens 32768 --micro-batches 2 \\
        --doc-lens 8192 --mixed 100-4000 --out $OUT/tp

``--profile``: at L = ``--profile-len`` (default the smallest of ``--doc-lens``), one log-prob
pass and one fwd+bwd pass per rope impl under ``torch.profiler``: the top ``--top`` kernels (calls,
total ms, % of GPU time), kernel launches per pass, GPU busy time (the union of kernel
intervals) vs wall time; a gzipped Chrome trace each under ``--out``.

``--host-profile``: cProfile of one pass of each kind at ``--profile-len`` (the last variant):
the ``--top`` Python functions by own time, where a host-bound pass spends it.

``--out DIR``: ``results.json`` (args, device, versions, model, FLOPs, rows, comparison,
profile).

The code: ``tools/bench_passes/`` (its ``__init__`` says which module holds what); this
script only reads the flags and sets the environment before it imports them.
"""

from __future__ import annotations

import os
import sys

# tools/bench_passes/cli.py imports no torch itself (--logprob-merge's default reads the
# trainer's config, which does, as it always did).
from bench_passes.cli import parse_args

ARGS = parse_args(description=__doc__.split("\n")[0]) if __name__ == "__main__" else None
if ARGS is not None and ARGS.device == "cpu":
    # Triton builds its library for the interpreter only if this is set before its first import.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from bench_passes.run import main  # noqa: E402  (imports torch, megatron-core, our ops)

if __name__ == "__main__":
    sys.exit(main(ARGS, script=__file__))
