"""The overlapped TP linear layers (``tp_overlap: ring`` and ``symm``) equal megatron-core's
ColumnParallelLinear / RowParallelLinear: outputs, returned biases, input / weight / bias
gradients, at TP 2 and 4, sequence parallelism on and off, odd per-rank token counts and odd
feature sizes; fp32 tightly, bf16 within twice megatron-core's own bf16 error against a float64
run of megatron-core's layers. One spawn per TP size, the cases looped inside (on the CPU the
symmetric-memory kind runs its ops' definitions over gloo). A tiny GPT built with each kind and
with ``off`` at TP 2 + SP gives the same log-probs, loss and gradients. On GPUs: the same cases
over NCCL (2 GPUs), and the symmetric-memory ops on one GPU.
"""

from __future__ import annotations

import pytest
import torch
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

from megatron_grpo.loss import GRPOLossConfig, reduce_metrics
from megatron_grpo.megatron import GRPOStep, ParallelConfig, initialize_parallel, unwrap
from megatron_grpo.megatron.model import tp_overlap
from megatron_grpo.megatron.model.tp_overlap import (
    RingColumnParallelLinear,
    RingRowParallelLinear,
    SymmColumnParallelLinear,
    SymmRowParallelLinear,
    resolve_tp_overlap,
    tp_linear_classes,
)
from megatron_grpo.ops.kernels import LayerKernels
from megatron_grpo.rollout.engine.fused_decode import unsupported
from tests.dist_utils import run_distributed
from tests.megatron_utils import (
    VOCAB,
    assert_close,
    build_layout,
    make_sequences,
    pack,
    tiny_model,
    train_grads,
)

DEVICE = ["cpu"]  # "cuda" in the NCCL run
LAYERS = {"column": ColumnParallelLinear, "row": RowParallelLinear}
KINDS = {"ring": {"column": RingColumnParallelLinear, "row": RingRowParallelLinear},
         "symm": {"column": SymmColumnParallelLinear, "row": SymmRowParallelLinear}}  # fmt: skip


def _config(tp: int, sp: bool, dtype: torch.dtype) -> ModelParallelConfig:
    return ModelParallelConfig(
        tensor_model_parallel_size=tp,
        sequence_parallel=sp,
        use_cpu_initialization=True,
        perform_initialization=False,
        params_dtype=dtype,
    )


def _build(cls, kind: str, tp: int, sp: bool, dtype, opts: dict, full: dict):
    """``cls`` at TP ``tp`` holding this rank's shard of the full weight and bias."""
    rank = torch.distributed.get_rank()
    h, o = full["weight"].shape[1], full["weight"].shape[0]
    kw = dict(config=_config(tp, sp, dtype), init_method=lambda w: None, bias=opts["bias"],
              skip_bias_add=opts["skip"])  # fmt: skip
    if kind == "column":
        layer = cls(h, o, gather_output=opts.get("gather", False), **kw)
        w, b = full["weight"].chunk(tp)[rank], full["bias"].chunk(tp)[rank]
    else:
        layer = cls(h, o, input_is_parallel=True, **kw)
        w, b = full["weight"].chunk(tp, dim=1)[rank], full["bias"]
    with torch.no_grad():
        layer.weight.copy_(w)
        if layer.bias is not None:
            layer.bias.copy_(b)
    layer.weight.requires_grad_(not opts.get("frozen", False))
    return layer.to(DEVICE[0])


def _run(layer, x: torch.Tensor, seed: int, no_grad: bool) -> dict[str, torch.Tensor]:
    """Forward (and backward with a seeded output gradient) -> every tensor to compare."""
    x = x.clone().requires_grad_(not no_grad)
    with torch.set_grad_enabled(not no_grad):
        out, out_bias = layer(x)
    res = {"out": out.detach()}
    if out_bias is not None:
        res["out_bias"] = out_bias.detach()
    if no_grad:
        return res
    g = torch.Generator().manual_seed(seed)
    outs = [t for t in (out, out_bias) if t is not None]  # a returned bias is the caller's too
    grads = [torch.randn(t.shape, generator=g).to(t.device, t.dtype) for t in outs]
    torch.autograd.backward(outs, grads)
    res["d_x"] = x.grad
    for name, p in (("d_weight", layer.weight), ("d_bias", layer.bias)):
        if p is not None and p.grad is not None:
            res[name] = p.grad
    return res


def _inputs(kind: str, tp: int, sp: bool, shape: tuple[int, int, int, int], seed: int):
    """(full weight/bias, this rank's input) for ``shape`` = (s, b, h, o) (all float64)."""
    rank = torch.distributed.get_rank()
    s, b, h, o = shape
    g = torch.Generator().manual_seed(seed)
    full = {"weight": torch.randn(o, h, generator=g, dtype=torch.float64) / h**0.5,
            "bias": torch.randn(o, generator=g, dtype=torch.float64)}  # fmt: skip
    x = torch.randn(s, b, h, generator=g, dtype=torch.float64)
    if kind == "row":
        x = x.chunk(tp, dim=2)[rank]  # input_is_parallel: this rank's features, every token
    elif sp:
        x = x.chunk(tp)[rank]  # sequence parallel: this rank's tokens
    return full, x


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got.double() - want.double()).abs().max().item()


def _case(kind: str, tp: int, sp: bool, dtype, opts: dict, seed: int, overlap: str) -> None:
    shape = (opts["s_per_rank"] * tp, opts["b"], opts["h"], opts["o"])
    full, x = _inputs(kind, tp, sp, shape, seed)
    base, ring = LAYERS[kind], KINDS[overlap][kind]
    no_grad = opts.get("no_grad", False)
    runs = {}
    for name, cls, dt in (("truth", base, torch.float64), ("megatron", base, dtype),
                          ("ring", ring, dtype)):  # fmt: skip
        layer = _build(cls, kind, tp, sp, dt, opts, full)
        runs[name] = _run(
            layer, x.to(DEVICE[0], dt), seed + 1 + torch.distributed.get_rank(), no_grad
        )
    want_keys = {"out"} | ({"out_bias"} if opts["skip"] and opts["bias"] else set())
    if not no_grad:
        want_keys |= {"d_x"} | (set() if opts.get("frozen") else {"d_weight"})
        # megatron-core's frozen-weight column path gives its bias no gradient
        frozen_column = opts.get("frozen") and kind == "column"
        want_keys |= {"d_bias"} if opts["bias"] and not frozen_column else set()
    label = f"{overlap} {kind} tp={tp} sp={sp} {dtype} {opts}"
    assert set(runs["ring"]) == set(runs["megatron"]) == want_keys, label
    for key, got in runs["ring"].items():
        want, truth = runs["megatron"][key], runs["truth"][key]
        assert got.shape == want.shape and got.dtype == want.dtype, f"{label} {key}"
        scale = truth.abs().max().item() + 1e-12
        if dtype == torch.float32:
            bound = 1e-5 * scale
        else:  # twice megatron-core's own bf16 error, plus a bf16 ulp of the scale
            bound = 2 * _err(want, truth) + 2**-8 * scale
        assert _err(got, want if dtype == torch.float32 else truth) <= bound, f"{label} {key}"


CASES = [  # (kind, options): odd per-rank token counts and odd feature sizes
    ("column", dict(s_per_rank=3, b=2, h=7, o=5, bias=True, skip=False, bf16=True)),
    ("column", dict(s_per_rank=5, b=1, h=9, o=3, bias=True, skip=True)),
    ("column", dict(s_per_rank=3, b=1, h=5, o=3, bias=False, skip=False, gather=True)),
    ("column", dict(s_per_rank=3, b=2, h=7, o=5, bias=True, skip=False, frozen=True)),
    ("column", dict(s_per_rank=1, b=3, h=5, o=3, bias=True, skip=False, no_grad=True)),
    ("row", dict(s_per_rank=3, b=2, h=3, o=7, bias=True, skip=False, bf16=True)),
    ("row", dict(s_per_rank=5, b=1, h=5, o=9, bias=True, skip=True)),
    ("row", dict(s_per_rank=3, b=1, h=3, o=5, bias=False, skip=False)),
    ("row", dict(s_per_rank=3, b=2, h=3, o=7, bias=True, skip=False, frozen=True)),
    ("row", dict(s_per_rank=1, b=3, h=3, o=5, bias=True, skip=False, no_grad=True)),
]


def _layers_body(rank: int, world: int, device: str = "cpu") -> None:
    DEVICE[0] = device
    initialize_parallel(ParallelConfig(tensor_model_parallel_size=world), seed=1)
    for overlap in KINDS:
        for i, (kind, opts) in enumerate(CASES):
            opts = {**opts, "h": opts["h"] * (world if kind == "row" else 1)}
            opts["o"] *= world if kind == "column" else 1
            for sp in (True, False):
                _case(kind, world, sp, torch.float32, opts, 10 * i, overlap)
            if opts.get("bf16"):
                _case(kind, world, True, torch.bfloat16, opts, 10 * i + 5, overlap)


@pytest.mark.parametrize("tp", [2, 4])
def test_overlap_layers_equal_megatron(tp):
    run_distributed(_layers_body, tp)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_overlap_layers_equal_megatron_nccl():
    """2 GPUs, NCCL (the P2P ring and the symmetric-memory ops on device): the same cases as
    over gloo.

    python -m pytest -q -m gpu tests/test_tp_overlap.py
    """
    run_distributed(_layers_body, 2, "cuda", backend="nccl")


def _symm_one_gpu_body(rank: int, world: int) -> None:
    from megatron_grpo.ops.layers.symm_linear import (
        symm_allgather_linear,
        symm_linear_reduce_scatter,
    )

    group = torch.distributed.new_group([0])
    g = torch.Generator().manual_seed(3)
    shapes = ((12, 2, 64), (48, 64), (48,), (32, 48))  # x, column weight and bias, row weight
    truth = [(torch.randn(*s, generator=g, dtype=torch.float64) / 4).cuda() for s in shapes]
    seed = torch.randn(12, 2, 32, generator=g, dtype=torch.float64).cuda()

    def run(fn, dtype):
        leaves = [t.to(dtype).requires_grad_(True) for t in truth]
        y = fn(*leaves)
        return [y, *torch.autograd.grad(y, leaves, seed.to(dtype))]

    def eager(x, w, b, w2):
        return (x @ w.t() + b) @ w2.t()

    def symm(x, w, b, w2):
        return symm_linear_reduce_scatter(symm_allgather_linear(x, w, b, group), w2, group)

    want, ref, got = (
        run(eager, torch.float64),
        run(eager, torch.bfloat16),
        run(symm, torch.bfloat16),
    )
    for name, w, r, o in zip(("y", "d_x", "d_w", "d_b", "d_w2"), want, ref, got, strict=True):
        assert o.shape == w.shape and o.dtype == torch.bfloat16, name
        bound = 2 * _err(r, w) + 2**-8 * w.abs().max().item()  # bf16's own error, and an ulp
        assert _err(o, w) <= bound, (name, _err(o, w), _err(r, w))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_symm_ops_run_on_one_gpu():
    """1 GPU: torch's symmetric-memory fused ops as the symm layers call them (a TP group of
    one: the calls, shapes and gradients on this torch; the overlap needs 2+ GPUs)."""
    run_distributed(_symm_one_gpu_body, 1, backend="nccl")


def _model_run(choice: str, params: dict | None):
    """(log-probs, loss, gradients by name, the model) of the tiny GPT built with
    ``tp_overlap=choice`` at TP 2 + SP, its parameters set to ``params`` when given."""
    cfg = tiny_model(layer_kernels=LayerKernels(tp_overlap=choice))
    par = ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True)
    chunks = build_layout(par, cfg)
    gpt = unwrap(chunks[0])
    if params is not None:
        with torch.no_grad():
            for name, p in gpt.named_parameters():
                p.copy_(params[name])
    batches = [pack(make_sequences(3, seed), multiple=2) for seed in (1, 2)]
    step = GRPOStep(GRPOLossConfig(), vocab_size=VOCAB, logprob_path="op")
    logp = step.compute_logprobs(chunks, batches)  # the log-prob pass: under no_grad
    for b, lp in zip(batches, logp, strict=True):  # on-policy: ratios 1, nothing clipped
        b.old_logprobs = lp
    loss = reduce_metrics(train_grads(chunks, step, batches))["loss/loss"]
    grads = {n: p.main_grad.detach().clone() for n, p in gpt.named_parameters()}
    return logp, loss, grads, gpt


def _model_body(rank: int, world: int, overlap: str) -> None:
    logp, loss, grads, gpt = _model_run("off", None)
    params = {n: p.detach().clone() for n, p in gpt.named_parameters()}
    ring_logp, ring_loss, ring_grads, ring_gpt = _model_run(overlap, params)
    layer = ring_gpt.decoder.layers[0]
    linears = (layer.self_attention.linear_qkv, layer.self_attention.linear_proj,
               layer.mlp.linear_fc1, layer.mlp.linear_fc2)  # fmt: skip
    assert [type(m) for m in linears] == [KINDS[overlap]["column"], KINDS[overlap]["row"]] * 2
    assert all(m._comm is not None for m in linears), "the overlap never ran"
    assert type(gpt.decoder.layers[0].mlp.linear_fc1) is ColumnParallelLinear
    assert unsupported(ring_gpt, tp_size=2) == "", "the fused decode step refuses the layers"
    for got, want in zip(ring_logp, logp, strict=True):
        assert_close("logprobs", got, want)
    assert_close("loss", torch.tensor(ring_loss), torch.tensor(loss))
    assert sum(float(g.norm()) for g in grads.values()) > 1e-4
    for name, g in ring_grads.items():
        assert_close(f"grad {name}", g, grads[name], tol=5e-5)


@pytest.mark.parametrize("overlap", list(KINDS))
def test_tiny_model_overlap_equals_off_tp2_sp(overlap):
    run_distributed(_model_body, 2, overlap)


def test_auto_resolves_to_ring_only_with_sp_on_cuda():
    assert resolve_tp_overlap("auto", True, 2, "cuda") == "off"  # opt-in until measured on GPU
    assert resolve_tp_overlap("auto", True, 2, "cpu") == "off"
    assert resolve_tp_overlap("auto", False, 2, "cuda") == "off"
    assert resolve_tp_overlap("auto", True, 1, "cuda") == "off"
    assert resolve_tp_overlap("ring", False, 1, "cpu") == "ring"  # explicit: megatron's without SP
    assert resolve_tp_overlap("off", True, 8, "cuda") == "off"
    assert resolve_tp_overlap("symm", True, 2, "cpu") == "symm"
    ahead = dict(tp_overlap.MEASURED_AHEAD)
    try:  # once a kind is measured ahead, auto takes it where it has something to hide
        tp_overlap.MEASURED_AHEAD.update(ring=True, symm=True)
        assert resolve_tp_overlap("auto", True, 4, "cuda") == "symm"
        assert resolve_tp_overlap("auto", True, 4, "cpu") == "off"
        tp_overlap.MEASURED_AHEAD.update(symm=False)
        assert resolve_tp_overlap("auto", True, 4, "cuda") == "ring"
    finally:
        tp_overlap.MEASURED_AHEAD.update(ahead)


def test_bad_choices_name_the_field():
    with pytest.raises(ValueError, match=r"tp_overlap must be one of .*did you mean 'ring'"):
        LayerKernels(tp_overlap="rng")
    with pytest.raises(ValueError, match="model.layer_kernels.tp_overlap"):
        resolve_tp_overlap("async", True, 2, "cuda")
    cfg = _config(2, True, torch.float32)
    with pytest.raises(ValueError, match="model.layer_kernels.tp_overlap='ring' is the portable"):
        tp_linear_classes("ring", cfg, use_te=True)
    assert tp_linear_classes("auto", cfg, use_te=True) == (ColumnParallelLinear, RowParallelLinear)
    assert tp_linear_classes("ring", cfg) == (RingColumnParallelLinear, RingRowParallelLinear)
    assert tp_linear_classes("symm", cfg) == (SymmColumnParallelLinear, SymmRowParallelLinear)
    assert tp_linear_classes("off", cfg) == (ColumnParallelLinear, RowParallelLinear)


@pytest.mark.parametrize("overlap", list(KINDS))
def test_overlap_refuses_gradient_accumulation_fusion(overlap):
    cfg = _config(2, True, torch.float32)
    cfg.gradient_accumulation_fusion = True
    with pytest.raises(ValueError, match=f"tp_overlap='{overlap}'.*gradient_accumulation_fusion"):
        KINDS[overlap]["row"](4, 4, config=cfg, init_method=lambda w: None, bias=False,
                              input_is_parallel=True, skip_bias_add=False)  # fmt: skip


def test_bench_tp_overlap_dry_run(tmp_path):
    """tools/bench_tp_overlap.py at TP 2 over gloo: every choice timed, each kind equal to off."""
    import json

    from tests.test_tools import run_tool

    args = ["--tokens", "6", "--hidden", "9", "--ffn", "6", "--qkv", "10", "--proj", "6"]
    run_tool("bench_tp_overlap.py", *args, "--iters", "1", "--warmup", "0", out=tmp_path, nproc=2)
    (row,) = json.loads((tmp_path / "bench_tp_overlap_tp2.json").read_text())["rows"]
    assert row["tokens"] == 6 and row["off"]["train_ms"] > 0
    for kind in ("ring", "symm"):
        assert row[kind]["logprob_ms"] > 0 and row[f"speedup_{kind}_train"] > 0, row
        assert row[f"{kind}_vs_off"] < 2**-7, row  # bf16: two summands in another order at most
