"""The LM-head GEMM with softmax epilogues (kernels/head_gemm.py) and its torch reference.

Both kernels ("pointer" and the persistent "tma" one) run in Triton's CPU interpreter at odd
sizes (rows, vocabulary and hidden not multiples of the blocks, targets outside the columns) in
fp32 and bf16, against float64 ground truth of the same (rounded) inputs: a kernel's error may be
at most the same-dtype torch reference's error plus a few units of roundoff. The GPU test runs
the real shape.
"""

from __future__ import annotations

import pytest
import torch

from megatron_grpo.ops.lm_head import reference
from megatron_grpo.ops.lm_head.stats import OVER_TILES, GlobalRowStats, RowStats, merge_row_stats
from tests.interpreter import interpreter_only, run_interpreter_tests

M, N, K = 70, 600, 96  # N: 3 blocks of 256, the last partial; K: not a multiple of 64
INV_T = 0.8


def test_interpreter_subprocess():
    run_interpreter_tests(__file__)


def _inputs(dtype: torch.dtype, m: int = M, n: int = N, k: int = K, device: str = "cpu"):
    g = torch.Generator().manual_seed(3)
    h = torch.randn(m, k, generator=g).to(dtype)
    w = (0.6 * torch.randn(n, k, generator=g)).to(dtype)
    w[5] = 3.0 * h[0]  # one sharply peaked row: a large logit next to small ones
    targets = torch.randint(-3, n + 3, (m,), generator=g)  # some outside [0, n): no column
    return h.to(device), w.to(device), targets.to(device)


def _exact(h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor):
    """float64 (lse, zt, pz, z) of z = h w^T * INV_T."""
    z = (h.double() @ w.double().t()) * INV_T
    lse = torch.logsumexp(z, dim=1)
    hit = (targets >= 0) & (targets < w.shape[0])
    zt = torch.where(hit, z.gather(1, targets.clamp(0, w.shape[0] - 1)[:, None])[:, 0], 0.0)
    pz = (torch.softmax(z, dim=1) * z).sum(1)
    return lse, zt, pz, z


def _merged(parts) -> GlobalRowStats:
    return GlobalRowStats.of(merge_row_stats(RowStats(*parts), OVER_TILES))


def _grad_exact(z, targets, lse, g, ge, pz):
    """float64 d loss / d logits of the epilogue's formula."""
    p = torch.exp(z - lse.double()[:, None])
    onehot = torch.zeros_like(z)
    hit = (targets >= 0) & (targets < z.shape[1])
    onehot[hit, targets[hit]] = 1.0
    dz = g.double()[:, None] * (onehot - p)
    if ge is not None:
        dz -= ge.double()[:, None] * p * (z - pz.double()[:, None])
    return dz * INV_T


def test_reference_block_stats_merge_to_the_row_stats():
    h, w, t = _inputs(torch.float32)
    lse, zt, pz, z = _exact(h, w, t)
    shifted = torch.empty(M, N)
    parts = reference.head_gemm_stats(h, w, t, INV_T, True, shifted=shifted)
    assert parts[0].shape == (3, M)  # cdiv(600, STATS_BLOCK) blocks
    st = _merged(parts)
    for got, want in ((st.lse, lse), (st.zt, zt), (st.pz, pz)):
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=2e-5)
    block_max = parts[0].t().repeat_interleave(reference.STATS_BLOCK, 1)[:, :N]
    torch.testing.assert_close((shifted + block_max).double(), z, rtol=1e-6, atol=2e-5)


def test_kernel_block_matches_the_reference_block():
    from megatron_grpo.kernels import head_gemm

    assert head_gemm.STATS_BLOCK_N == reference.STATS_BLOCK


@interpreter_only
@pytest.mark.parametrize("kernel", ["pointer", "tma"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stats_interpreter(kernel, dtype):
    from megatron_grpo.kernels import head_gemm_stats

    h, w, t = _inputs(dtype)
    lse, zt, pz, z = _exact(h, w, t)
    shifted = torch.empty(M, N, dtype=dtype)
    parts = head_gemm_stats(h, w, t, INV_T, True, shifted=shifted, kernel=kernel)
    ref_parts = reference.head_gemm_stats(h, w, t, INV_T, True)
    for got, want in zip(parts, ref_parts, strict=True):  # same blocks, fp32 accumulators
        torch.testing.assert_close(got, want, rtol=1e-5, atol=5e-5)
    st = _merged(parts)
    for got, want in ((st.lse, lse), (st.zt, zt), (st.pz, pz)):
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=5e-5)
    no_ent = head_gemm_stats(h, w, t, INV_T, False, kernel=kernel)
    assert no_ent[3] is None and torch.equal(no_ent[0], parts[0])
    # The stored z - m is z's block shift removed, rounded once to the dtype (plus the fp32
    # accumulator's error, relative to z).
    block_max = parts[0].t().repeat_interleave(reference.STATS_BLOCK, 1)[:, :N].double()
    exact_shifted = z - block_max
    err = (shifted.double() - exact_shifted).abs()
    ulp = torch.finfo(dtype).eps * exact_shifted.abs() + 1e-6 * z.abs() + 1e-5
    assert (err <= ulp).all(), err.max()


@interpreter_only
@pytest.mark.parametrize("kernel", ["pointer", "tma"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("entropy", [False, True])
def test_grad_interpreter(kernel, dtype, entropy):
    from megatron_grpo.kernels import head_gemm_grad

    h, w, t = _inputs(dtype)
    lse, _, pz, z = _exact(h, w, t)
    g = torch.Generator().manual_seed(4)
    g_lp = torch.randn(M, generator=g)
    g_ent, pz32 = (torch.randn(M, generator=g), pz.float()) if entropy else (None, None)
    exact = _grad_exact(z, t, lse, g_lp, g_ent, pz32)
    args = (h, w, t, INV_T, lse.float(), g_lp, g_ent, pz32)
    got = head_gemm_grad(*args, kernel=kernel)
    want = reference.head_gemm_grad(*args)
    assert got.dtype == want.dtype == dtype
    err_ref = (want.double() - exact).abs().max()
    err = (got.double() - exact).abs().max()
    assert err <= err_ref + 2 * torch.finfo(dtype).eps * exact.abs().max(), (err, err_ref)


@interpreter_only
def test_tma_kernel_output_rows_not_16_byte_aligned_interpreter():
    """An output whose rows are not 16-byte aligned (601 bf16 columns) cannot be a TMA store's
    tensor: the TMA kernel stores it by pointers, with the same values as the aligned store."""
    from megatron_grpo.kernels import head_gemm_grad, head_gemm_stats

    h, w, t = _inputs(torch.bfloat16, n=601)
    g = torch.Generator().manual_seed(6)
    lse, g_lp = torch.randn(M, generator=g) + 8.0, torch.randn(M, generator=g)
    got = head_gemm_grad(h, w, t, INV_T, lse, g_lp, kernel="tma")
    torch.testing.assert_close(got, head_gemm_grad(h, w, t, INV_T, lse, g_lp, kernel="pointer"))
    shifted = {k: torch.empty(M, 601, dtype=torch.bfloat16) for k in ("tma", "pointer")}
    for kind, out in shifted.items():
        head_gemm_stats(h, w, t, INV_T, False, shifted=out, kernel=kind)
    torch.testing.assert_close(shifted["tma"], shifted["pointer"])
    padded = torch.empty(M, 608, dtype=torch.bfloat16)[:, :601]  # rows aligned: a TMA store
    head_gemm_stats(h, w, t, INV_T, False, shifted=padded, kernel="tma")
    torch.testing.assert_close(padded, shifted["pointer"])


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shifted_logits_grad_interpreter(dtype):
    """logits_grad on the stored shifted logits (block_shift) gives the gradient of the exact
    logits within the same-dtype torch reference's error plus roundoff."""
    from megatron_grpo.kernels import head_gemm_stats, logits_grad

    h, w, t = _inputs(dtype)
    lse, _, pz, z = _exact(h, w, t)
    shifted = torch.empty(M, N, dtype=dtype)
    parts = head_gemm_stats(h, w, t, INV_T, True, shifted=shifted)
    g = torch.Generator().manual_seed(5)
    rows = (t, N, INV_T, lse.float(), torch.randn(M, generator=g), torch.randn(M, generator=g),
            pz.float())  # fmt: skip
    exact = _grad_exact(z, t, *rows[3:])
    shift = dict(block_shift=parts[0], shift_block=reference.STATS_BLOCK)
    want = reference.logits_grad(shifted.clone(), *rows, out=shifted.clone(), **shift)
    got = shifted.clone()
    logits_grad(got, *rows, out=got, **shift)  # in place
    err_ref = (want.double() - exact).abs().max()
    err = (got.double() - exact).abs().max()
    assert err <= err_ref + 2 * torch.finfo(dtype).eps * exact.abs().max(), (err, err_ref)


@interpreter_only
def test_empty_and_bad_inputs_interpreter():
    from megatron_grpo.kernels import head_gemm_grad, head_gemm_stats

    h, w, t = _inputs(torch.float32)
    m, s, zt, b = head_gemm_stats(h[:0], w, t[:0], INV_T, True)
    assert m.shape == (3, 0) and b.shape == (3, 0)
    with pytest.raises(ValueError, match="share a float dtype"):
        head_gemm_stats(h.bfloat16(), w, t, INV_T, False)
    with pytest.raises(ValueError, match="targets_local"):
        head_gemm_stats(h, w, t[:5], INV_T, False)
    with pytest.raises(ValueError, match="shifted must be torch.float32"):
        head_gemm_stats(h, w, t, INV_T, False, shifted=torch.empty(M, N, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="kernel must be one of"):
        head_gemm_stats(h, w, t, INV_T, False, kernel="cublas")
    with pytest.raises(ValueError, match="given together"):
        head_gemm_grad(h, w, t, INV_T, torch.zeros(M), torch.zeros(M), grad_entropy=torch.zeros(M))


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["pointer", "tma"])
def test_gpu_real_shape(kernel):
    """T = 1024 rows of a 152k shard, H = 4096, bf16: log-sum-exp and target logit within 1e-4
    of float64; the gradient epilogue within the bf16 reference's error plus roundoff."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from megatron_grpo.kernels import head_gemm_grad, head_gemm_stats

    g = torch.Generator(device="cuda").manual_seed(6)
    h = torch.randn(1024, 4096, device="cuda", generator=g).bfloat16()
    w = (0.02 * torch.randn(151936, 4096, device="cuda", generator=g)).bfloat16()
    t = torch.randint(0, 151936, (1024,), device="cuda", generator=g)
    lse, zt, pz, z = _exact(h, w, t)
    st = _merged(head_gemm_stats(h, w, t, INV_T, True, kernel=kernel))
    errs = [(st.lse.double() - lse).abs().max().item(), (st.zt.double() - zt).abs().max().item()]
    assert max(errs) < 1e-4, errs
    g_lp = torch.randn(1024, device="cuda")
    exact = _grad_exact(z, t, lse, g_lp, None, None)
    got = head_gemm_grad(h, w, t, INV_T, lse.float(), g_lp, kernel=kernel)
    want = reference.head_gemm_grad(h, w, t, INV_T, lse.float(), g_lp)
    err_ref = (want.double() - exact).abs().max().item()
    err = (got.double() - exact).abs().max().item()
    assert err <= err_ref + 2 * torch.finfo(torch.bfloat16).eps * exact.abs().max().item(), (
        err,
        err_ref,
    )
