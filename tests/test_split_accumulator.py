"""The split d_weight accumulator (kernels/split_accumulator.py, its torch reference in
ops/lm_head/reference.py) and the single pass that uses it (a bf16 weight without main_grad).

The pair ``hi + lo * scale(hi)`` must hold a sum of many GEMMs to about 2^-15 of its magnitude,
so the gradient resolved from it is the float64 truth rounded once to bf16, where summing in
bf16 chunk by chunk is measurably worse. Both kernels ("pointer", persistent "tma") run in
Triton's CPU interpreter at odd sizes against float64; the GPU test runs the real shape.
"""

from __future__ import annotations

import pytest
import torch

from megatron_grpo.loss import GRPOLossConfig
from megatron_grpo.ops import fused_grpo_loss, fused_grpo_loss_plan
from megatron_grpo.ops.lm_head import reference as ref
from tests.interpreter import interpreter_only, run_interpreter_tests
from tests.test_fused_grpo import VOCAB, loss_batch, make_inputs

K, M, N = 37, 136, 80  # K: not a multiple of 64; M, N: partial tiles (16-byte rows)
CHUNKS = 12


def test_interpreter_subprocess():
    run_interpreter_tests(__file__)


def _chunks(dtype: torch.dtype, m: int = M, n: int = N, k: int = K, chunks: int = CHUNKS):
    """Chunks (a [k, m], b [k, n]) whose products share a sign pattern, so the running sum
    grows (a bf16 sum then loses the small late terms) plus a few large outliers."""
    g = torch.Generator().manual_seed(5)
    base = torch.randn(k, m, generator=g)
    out = []
    for i in range(chunks):
        a = base + 0.3 * torch.randn(k, m, generator=g)
        a[0, i % m] *= 40.0
        out.append((a.to(dtype), torch.randn(k, n, generator=g).abs().to(dtype)))
    return out


def _truth(chunks) -> torch.Tensor:
    return sum(a.double().t() @ b.double() for a, b in chunks)


def _value(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """float64 value of the pair."""
    return hi.double() + lo.double() * ref.split_scale(hi.float()).double()


def _run(addmm, chunks, m: int = M, n: int = N, **kw):
    hi = torch.full((m, n), float("nan"), dtype=torch.bfloat16)  # `first` must not read them
    lo = torch.full((m, n), 99, dtype=torch.int8)
    for i, (a, b) in enumerate(chunks):
        addmm(a, b, hi, lo, i == 0, **kw)
    return hi, lo


def _rel(x: torch.Tensor, truth: torch.Tensor) -> float:
    return ((x.double() - truth).norm() / truth.norm()).item()


def _bound(chunks) -> tuple[torch.Tensor, torch.Tensor]:
    """(float64 sum, error bound of the pair): each step's residual is rounded to half a unit
    of ``scale(hi) <= 2^-14 |hi|``, so the error is at most ``2^-15 sum_j |S_j|`` over the
    partial sums S_j, plus the fp32 GEMMs'."""
    partial, bound = 0, 0
    for a, b in chunks:
        a, b = a.double(), b.double()
        partial = partial + a.t() @ b
        bound = bound + 2.0**-15 * partial.abs() + 2.0**-20 * (a.abs().t() @ b.abs())
    return partial, bound


def _check_pair(hi, lo, chunks) -> None:
    """The pair holds the sum within :func:`_bound`; the residual stays in [-64, 64]."""
    assert lo.abs().max() <= 64
    truth, bound = _bound(chunks)
    err = (_value(hi, lo) - truth).abs()
    assert (err <= bound).all(), (err - bound).max()


def _check_resolved(grad, chunks, scale: float) -> None:
    """Rounded once: within half a bf16 unit of the scaled pair, itself within the bound."""
    truth, bound = _bound(chunks)
    want = scale * truth
    err = (grad.double() - want).abs()
    assert (err <= scale * bound + torch.finfo(torch.bfloat16).eps * want.abs()).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_sum_is_the_truth_rounded_once(dtype):
    chunks = _chunks(dtype)
    truth = _truth(chunks)
    hi, lo = _run(ref.split_acc_addmm, chunks)
    _check_pair(hi, lo, chunks)
    grad = ref.split_acc_resolve(hi, lo, torch.tensor([1.0]))
    once = _rel(truth.to(torch.bfloat16), truth)
    assert _rel(grad, truth) <= once * 1.01 + 1e-7
    # Summed in bf16 chunk by chunk the same gradient is measurably worse: the test can fail.
    acc = torch.zeros(M, N, dtype=torch.bfloat16)
    for a, b in chunks:
        acc = (acc.float() + a.float().t() @ b.float()).to(torch.bfloat16)
    assert _rel(acc, truth) > 1.5 * once


def test_reference_resolve_applies_the_scale_once():
    chunks = _chunks(torch.bfloat16)
    hi, lo = _run(ref.split_acc_addmm, chunks)
    _check_pair(hi, lo, chunks)
    _check_resolved(ref.split_acc_resolve(hi, lo, torch.tensor([0.37])), chunks, 0.37)


@interpreter_only
@pytest.mark.parametrize(  # the TMA kernel serves 16-bit operands; 2 programs per "SM"
    ("kernel", "dtype", "ctas"),
    [("pointer", torch.float32, 1), ("pointer", torch.bfloat16, 1), ("tma", torch.bfloat16, 1),
     ("tma", torch.bfloat16, 2)],
)  # fmt: skip
def test_addmm_interpreter(kernel, dtype, ctas):
    from megatron_grpo.kernels import split_acc_addmm, split_acc_resolve

    chunks = _chunks(dtype)
    cfg = dict(BLOCK_M=64, BLOCK_N=32, CTAS_PER_SM=ctas)
    hi, lo = _run(split_acc_addmm, chunks, kernel=kernel, config=cfg)
    _check_pair(hi, lo, chunks)  # (the reference may round a tie the other way: equal bounds)
    _check_resolved(split_acc_resolve(hi, lo, torch.tensor([0.37])), chunks, 0.37)


@interpreter_only
def test_rows_of_a_larger_pair_and_strided_a_interpreter():
    """The single pass passes the valid rows of the [V_local, H] pair and d logits with a row
    stride wider than M (fp32 logits reused as bf16); K = 0 adds nothing."""
    from megatron_grpo.kernels import split_acc_addmm

    chunks = _chunks(torch.bfloat16, m=50, n=24, k=9, chunks=3)
    wide = [(torch.cat([a, torch.zeros_like(a)], 1)[:, :50], b) for a, b in chunks]
    assert wide[0][0].stride(0) == 100
    hi = torch.zeros(60, 24, dtype=torch.bfloat16)
    lo = torch.zeros(60, 24, dtype=torch.int8)
    for i, (a, b) in enumerate(wide):
        split_acc_addmm(a, b, hi[:50], lo[:50], i == 0)
    split_acc_addmm(wide[0][0][:0], wide[0][1][:0], hi[:50], lo[:50], False)
    _check_pair(hi[:50], lo[:50], chunks)
    assert not hi[50:].any() and not lo[50:].any()


@interpreter_only
def test_bad_inputs_interpreter():
    from megatron_grpo.kernels import split_acc_addmm, split_acc_resolve

    a, b = torch.zeros(4, 8, dtype=torch.bfloat16), torch.zeros(4, 16, dtype=torch.bfloat16)
    hi, lo = torch.zeros(8, 16, dtype=torch.bfloat16), torch.zeros(8, 16, dtype=torch.int8)
    with pytest.raises(ValueError, match="hi must be a 2-D bfloat16"):
        split_acc_addmm(a, b, hi.float(), lo, True)
    with pytest.raises(ValueError, match="lo must be an int8 tensor of hi's shape"):
        split_acc_addmm(a, b, hi, lo[:4], True)
    with pytest.raises(ValueError, match=r"must share dtype and K, with \[M, N\]"):
        split_acc_addmm(a, b[:3], hi, lo, True)
    with pytest.raises(ValueError, match="kernel must be one of"):
        split_acc_addmm(a, b, hi, lo, True, kernel="cublas")
    with pytest.raises(ValueError, match="scale must be a one-element float32"):
        split_acc_resolve(hi, lo, torch.tensor([1.0, 2.0]))


def _single_pass_bf16(impl: str, chunk_size: int = 3):
    """fused_grpo_loss on the single pass with a bf16 weight and no main_grad (d_weight in the
    split accumulator), grad_output 0.7; returns (plan, d_hidden, d_weight)."""
    t, h, v = 30, 16, 40
    hidden, weight, _ = make_inputs(t, h, v, dtype=torch.bfloat16)
    targets, batch = loss_batch(hidden, weight, 0.8)
    hidden.requires_grad_()
    weight.requires_grad_()
    kw = dict(vocab_size=VOCAB, temperature=0.8, chunk_size=chunk_size, impl=impl,
              path="fused_single_pass", **batch)  # fmt: skip
    cfg = GRPOLossConfig(kl_coef=0.05, entropy_coef=0.01)
    plan = fused_grpo_loss_plan(hidden, weight, targets, cfg, **kw)
    loss, _, _ = fused_grpo_loss(hidden, weight, targets, cfg, **kw)
    (0.7 * loss).backward()
    return plan, hidden.grad, weight.grad


def test_single_pass_bf16_weight_sums_in_the_split_accumulator():
    """Many 3-row chunks: d_weight equals the tiled path's (one fp32 sum per tile, rounded
    once) up to a bf16 unit in the last place, and the plan says where it was summed."""
    plan, dh, dw = _single_pass_bf16("torch")
    assert plan.path == "fused_single_pass" and plan.accumulator == "split"
    assert plan.accumulator_bytes == 40 * 16 and "bf16 + int8 residual" in str(plan)
    assert dw.dtype == torch.bfloat16
    _, _, one = _single_pass_bf16("torch", chunk_size=30)  # one chunk: nothing to carry
    ulp = torch.finfo(torch.bfloat16).eps * one.float().abs()
    assert ((dw.float() - one.float()).abs() <= ulp + 1e-6).all()


@interpreter_only
def test_single_pass_split_accumulator_triton_interpreter():
    plan, dh, dw = _single_pass_bf16("triton")
    assert plan.accumulator == "split" and plan.impl == "triton"
    _, rdh, rdw = _single_pass_bf16("torch")
    for got, want in ((dh, rdh), (dw, rdw)):  # both round d logits to bf16: within a few ulp
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2,
                                   atol=1e-2 * want.float().abs().max().item())  # fmt: skip


@pytest.mark.gpu
def test_gpu_real_shape_sums_like_fp32():
    """V = 151936, H = 4096, 7 chunks of 1344 rows (the default budget's chunks at T = 8192):
    the resolved gradient is the fp32 sum rounded once, where a bf16 sum is not."""
    from megatron_grpo.kernels import split_acc_addmm, split_acc_resolve

    from megatron_grpo.ops.lm_head.gemm import mm_f32

    v, hd, c, dev = 151936, 4096, 1344, torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    hi = torch.empty(v, hd, device=dev, dtype=torch.bfloat16)
    lo = torch.empty(v, hd, device=dev, dtype=torch.int8)
    acc32 = torch.zeros(v, hd, device=dev)
    acc16 = torch.zeros(v, hd, device=dev, dtype=torch.bfloat16)
    for i in range(7):
        dl = (torch.randn(c, v, generator=g, device=dev) * 1e-3 + 1e-4).to(torch.bfloat16)
        h = torch.randn(c, hd, generator=g, device=dev).to(torch.bfloat16)
        split_acc_addmm(dl, h, hi, lo, i == 0)
        mm_f32(dl.t(), h, acc=acc32)
        acc16.addmm_(dl.t(), h)
    grad = split_acc_resolve(hi, lo, torch.ones(1, device=dev))

    def rel(x):
        return ((x.float() - acc32).norm() / acc32.norm()).item()

    once = rel(acc32.to(torch.bfloat16))
    print(
        f"rel err: split {rel(grad):.3e}, fp32 rounded once {once:.3e}, bf16 sum {rel(acc16):.3e}"
    )
    assert rel(grad) <= 1.02 * once and rel(acc16) > 1.5 * once


@pytest.mark.gpu
def test_gpu_single_pass_without_main_grad():
    """The TP = 8 shard of a 151936 vocabulary, bf16 weight, no main_grad, a budget of several
    chunks: the single pass runs with the split accumulator, its d_weight error against fp64
    is within the tiled path's (one fp32 sum per tile, rounded once)."""
    from tests.test_fused_grpo import CONFIGS, _gpu_problem, fp64_grads

    t, h, v = 4096, 1024, 18992
    cfg = GRPOLossConfig(**CONFIGS["token_full"])
    hidden, weight, targets, batch = _gpu_problem(t, h, v, 512, 64)
    grads = {}
    for path in ("fused_single_pass", "fused_tiled"):
        hh, ww = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        kw = dict(path=path, memory_budget=v * h + 600 * (2 * v + 16 * 75 + 4 * h), **batch)
        plan = fused_grpo_loss_plan(hh, ww, targets, cfg, **kw)
        loss, _, _ = fused_grpo_loss(hh, ww, targets, cfg, **kw)
        loss.backward()
        grads[path] = (plan, hh.grad, ww.grad)
    plan = grads["fused_single_pass"][0]
    assert plan.accumulator == "split" and plan.chunk_rows == 576, str(plan)
    dh64, dw64 = fp64_grads(cfg, hidden, weight, targets, batch)
    errs = {p: (_rel(g[1], dh64), _rel(g[2], dw64)) for p, g in grads.items()}
    print(f"(dh, dw) rel err {errs}")
    for single, tiled in zip(errs["fused_single_pass"], errs["fused_tiled"], strict=True):
        assert single <= 1.1 * tiled + 1e-4, errs
