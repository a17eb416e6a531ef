"""Triton kernels of the log-prob op against float64 ground truth.

CPU tests run the kernels in Triton's CPU interpreter. Triton builds its own library for the
interpreter only when TRITON_INTERPRET=1 is set before its first import (megatron.core imports
it), so `test_interpreter_subprocess` re-runs this module's interpreter tests in a fresh
`pytest` process with that variable set; other tests in this process are unaffected, and the
interpreter tests skip here unless this process was itself started under the interpreter.
GPU tests (marked gpu) run the compiled kernels at full size. Each kernel's error against
float64 must stay within the same-dtype torch reference's error plus a small tolerance.
"""

from __future__ import annotations

import importlib
import itertools
import math
import sys

import pytest
import torch

triton = pytest.importorskip("triton")

from megatron_grpo.kernels import logits_grad, logits_row_stats  # noqa: E402

import megatron_grpo  # noqa: E402
from tests.interpreter import IN_INTERPRETER, interpreter_only, run_interpreter_tests  # noqa: E402

STATS_MOD = importlib.import_module("megatron_grpo.kernels.logits_row_stats")
GRAD_MOD = importlib.import_module("megatron_grpo.kernels.logits_grad")
STATS_DEFAULT_BLOCK, GRAD_DEFAULT_BLOCK = STATS_MOD.BLOCK_V, GRAD_MOD.BLOCK_V
NEG_INF = float("-inf")


def test_interpreter_subprocess():
    """Run this module's interpreter tests in a fresh process with TRITON_INTERPRET=1."""
    run_interpreter_tests(__file__)


# --------------------------------------------------------------------------- references


def ref_stats(logits, targets, n_valid, inv_t, dtype):
    """(m, s, zt, b) computed by torch in `dtype` (float64 = ground truth)."""
    z = logits[:, :n_valid].to(dtype) * inv_t
    rows = logits.size(0)
    if n_valid == 0:
        zeros = torch.zeros(rows, dtype=dtype, device=logits.device)
        return torch.full_like(zeros, NEG_INF), zeros, zeros, zeros
    m = z.max(dim=1).values
    e = torch.exp(z - m[:, None])
    in_shard = (targets >= 0) & (targets < n_valid)
    zt = torch.where(in_shard, z.gather(1, targets.clamp(0, n_valid - 1)[:, None])[:, 0], 0.0)
    return m, e.sum(1), zt, (e * z).sum(1)


def ref_grad(logits, targets, n_valid, inv_t, lse, g_logp, g_ent, pz, dtype):
    """d logits in `dtype` arithmetic, padded columns 0 (the contract's formula)."""
    z = logits.to(dtype) * inv_t
    cols = torch.arange(logits.size(1), device=logits.device)
    valid = cols[None, :] < n_valid
    p = torch.where(valid, torch.exp(z - lse.to(dtype)[:, None]), 0.0)
    onehot = (valid & (cols[None, :] == targets[:, None])).to(dtype)
    dz = g_logp.to(dtype)[:, None] * (onehot - p)
    if g_ent is not None:
        dz = dz - g_ent.to(dtype)[:, None] * p * (z - pz.to(dtype)[:, None])
    return dz * inv_t


FP32_U = 2.0**-24  # unit roundoff of float32


def grad_error_bound(logits, targets, n_valid, inv_t, lse, g_logp, g_ent, pz):
    """Per-element first-order error bound of an fp32 evaluation of the d logits formula.

    The inputs (logits, lse, pz, grads) are exact; each rounding costs at most u = 2^-24:
    ``z = x * inv_t`` (inv_t itself rounded to fp32) is off by 2u|z|, so the exponent
    ``a = z - lse`` by 2u|z| + u|a|; exp adds a few ulps and exp2-based implementations u|a|:
    ``|dp| / p <= u (2|z| + 3|a| + 6)``. ``w = z - pz`` is off by u (2|z| + |w|). The final
    products and sums add a few u of their terms. Large logits (|z| ~ 1e4) make the bound
    large: the argument of exp is then only known to ~1e-3 in fp32, in any implementation, and
    which rounding sequence (FMA contraction, exp2 vs expf) hits closer varies element by
    element. A factor 2 covers the second-order terms.
    """
    z = logits.double() * inv_t
    cols = torch.arange(logits.size(1), device=logits.device)
    valid = cols[None, :] < n_valid
    a = z - lse.double()[:, None]
    p = torch.where(valid, torch.exp(a), 0.0)
    onehot = (valid & (cols[None, :] == targets[:, None])).double()
    g = g_logp.double().abs()[:, None]
    ge = torch.zeros_like(g) if g_ent is None else g_ent.double().abs()[:, None]
    w = torch.zeros_like(z) if g_ent is None else (z - pz.double()[:, None]).abs()
    z, a = z.abs(), a.abs()
    err = (g + ge * w) * p * (2 * z + 3 * a + 6) + ge * p * (2 * z + w)
    err += 4 * (g * (onehot + p) + ge * p * w)
    return torch.where(valid, 2 * FP32_U * inv_t * err, 0.0)


def derived(m, s, zt, b):
    """lse, the target log-prob and the p-weighted mean of z: what the op builds from stats."""
    lse = m + torch.log(s)
    return lse, zt - lse, b / s


def scaled_err(x, ref):
    """max |x - ref| / (1 + |ref|) over finite refs; inf where x is not finite."""
    x, ref = x.double(), ref.double()
    if not torch.isfinite(x).all():
        return math.inf
    return ((x - ref).abs() / (1 + ref.abs())).max().item() if ref.numel() else 0.0


# --------------------------------------------------------------------------- inputs

V_LOCAL = 301  # odd: not divisible by any block size


def make_logits(dtype, rows=6, v=V_LOCAL, seed=0):
    """Random rows plus the hard cases: +-1e4, all very negative, ties, a wide spread."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, v, generator=g) * 3
    x[1, 5], x[1, 17] = 1e4, -1e4
    x[2] = -1e4 + torch.randn(v, generator=g)
    x[3] = -50.0 + torch.randn(v, generator=g)
    x[4] = 0.75
    x[5] = (torch.rand(v, generator=g) * 2 - 1) * 1e4
    return x.to(dtype)


def make_targets(rows, n_valid, v=V_LOCAL):
    """In-shard, negative (other shard below), in the padded columns, beyond the shard."""
    last = max(n_valid - 1, 0)
    base = [0, 5, last, -1, min(n_valid, v - 1), v + 3, 17, 200 % max(n_valid, 1)]
    return torch.tensor((base * rows)[:rows], dtype=torch.int64)


# name -> (n_valid, inv_temperature)
SHARDS = {"full": (V_LOCAL, 1.0), "padded": (250, 1 / 0.7), "empty": (0, 2.0)}


# --------------------------------------------------------------------------- CPU (interpreter)


# (shard, with_entropy, tile size) looped inside one test per dtype / output mode: every shard x
# entropy with the default config (one tile per row), and several tiles per row with a partial
# last one (64) where there are columns.
COMBOS = [(*c, None) for c in itertools.product(SHARDS, (True, False))]
COMBOS += [("full", True, 64), ("padded", True, 64), ("padded", False, 64)]


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_row_stats_interpreter(monkeypatch, dtype):
    for shard, with_entropy, block in COMBOS:
        monkeypatch.setattr(STATS_MOD, "BLOCK_V", block or STATS_DEFAULT_BLOCK)
        try:
            _check_row_stats(dtype, shard, with_entropy)
        except AssertionError as e:
            raise AssertionError(f"shard={shard} entropy={with_entropy} block={block}") from e


def _check_row_stats(dtype, shard, with_entropy):
    n_valid, inv_t = SHARDS[shard]
    x = make_logits(dtype)
    t = make_targets(x.size(0), n_valid)
    m, s, zt, b = logits_row_stats(x, t, n_valid, inv_t, with_entropy)
    assert all(v.dtype == torch.float32 and v.shape == (x.size(0),) for v in (m, s, zt))
    assert (b is not None) == with_entropy
    r64 = ref_stats(x, t, n_valid, inv_t, torch.float64)
    if n_valid == 0:
        assert torch.equal(m, torch.full_like(m, NEG_INF))
        assert torch.equal(s, torch.zeros_like(s)) and torch.equal(zt, torch.zeros_like(zt))
        assert b is None or torch.equal(b, torch.zeros_like(b))
        return
    r32 = ref_stats(x, t, n_valid, inv_t, torch.float32)
    # m and zt are single rounded products in both: exact agreement with torch fp32.
    assert torch.equal(m, r32[0]) and torch.equal(zt, r32[2])
    out_shard = (t < 0) | (t >= n_valid)
    assert torch.equal(zt[out_shard], torch.zeros_like(zt[out_shard]))
    assert scaled_err(s, r64[1]) <= scaled_err(r32[1], r64[1]) + 1e-6
    # lse and logp always; the p-weighted mean of z (the entropy's b / s) with entropy.
    n_checked = 3 if with_entropy else 2
    b_k = b if with_entropy else r32[3]
    pairs = zip(derived(m, s, zt, b_k), derived(*r32), derived(*r64), strict=True)
    for got, want32, want64 in list(pairs)[:n_checked]:
        assert scaled_err(got, want64) <= scaled_err(want32, want64) + 2e-6


OUT_MODES = {
    # name -> (logits dtype, out: None | "inplace" | dtype)
    "fp32": (torch.float32, None),
    "fp32_inplace": (torch.float32, "inplace"),
    "bf16": (torch.bfloat16, None),
    "bf16_inplace": (torch.bfloat16, "inplace"),
    "bf16_to_fp32_out": (torch.bfloat16, torch.float32),
    "fp32_to_bf16_out": (torch.float32, torch.bfloat16),
    "fp32_narrow_bf16_alias": (torch.float32, "narrow"),  # bf16 rows over the fp32 rows
}


def _grad_inputs(x, t, n_valid, inv_t, with_entropy, seed=1):
    """Float64 lse / sum p z from the full row (as after the TP combine), random fp32 grads."""
    g = torch.Generator().manual_seed(seed)
    rows = x.size(0)
    if n_valid:
        m, s, _, b = ref_stats(x, t, n_valid, inv_t, torch.float64)
        lse64, pz64 = m + torch.log(s), b / s
    else:  # the global stats come from other shards
        lse64 = torch.randn(rows, generator=g, dtype=torch.float64) + 5
        pz64 = torch.randn(rows, generator=g, dtype=torch.float64)
    g_logp = torch.randn(rows, generator=g)
    g_ent = torch.randn(rows, generator=g) if with_entropy else None
    pz = pz64.float() if with_entropy else None
    return lse64.float(), g_logp, g_ent, pz


@interpreter_only
@pytest.mark.parametrize("mode", list(OUT_MODES))
def test_grad_interpreter(monkeypatch, mode):
    for shard, with_entropy, block in COMBOS:
        monkeypatch.setattr(GRAD_MOD, "BLOCK_V", block or GRAD_DEFAULT_BLOCK)
        try:
            _check_grad(mode, shard, with_entropy)
        except AssertionError as e:
            raise AssertionError(f"shard={shard} entropy={with_entropy} block={block}") from e


def _check_grad(mode, shard, with_entropy):
    dtype, out_spec = OUT_MODES[mode]
    n_valid, inv_t = SHARDS[shard]
    x = make_logits(dtype)
    t = make_targets(x.size(0), n_valid)
    lse, g_logp, g_ent, pz = _grad_inputs(x, t, n_valid, inv_t, with_entropy)
    x_orig = x.clone()
    if out_spec == "inplace":
        out = x
    elif out_spec == "narrow":
        out = x.view(torch.bfloat16)[:, : x.size(1)]
    elif out_spec is None:
        out = None
    else:
        out = torch.full(x.shape, float("nan"), dtype=out_spec)  # every element must be written
    d = logits_grad(x, t, n_valid, inv_t, lse, g_logp, g_ent, pz, out=out)
    out_dtype = {None: dtype, "inplace": dtype, "narrow": torch.bfloat16}.get(out_spec, out_spec)
    assert d.dtype == out_dtype and d.shape == x.shape
    if out is not None:
        assert d.data_ptr() == out.data_ptr()
    assert torch.isfinite(d).all()
    assert torch.equal(d[:, n_valid:], torch.zeros_like(d[:, n_valid:]))
    args = (x_orig, t, n_valid, inv_t, lse, g_logp, g_ent, pz)
    d64 = ref_grad(*args, torch.float64)
    # The fp32 torch reference's error, before any rounding to the output dtype.
    err32 = (ref_grad(*args, torch.float32).double() - d64).abs().max().item()
    # Low-precision output: the GPU rounds to nearest (half an ulp <= eps/2 * |x|, checked by the
    # gpu test), Triton 3.9's interpreter truncates fp32 -> bf16 casts (up to a whole ulp).
    ulp = 0.0 if out_dtype == torch.float32 else torch.finfo(out_dtype).eps
    bound = ulp * d64.abs() + err32 + 1e-6 * d64.abs().max().item() + 1e-12
    assert ((d.double() - d64).abs() <= bound).all()
    # The first-order bound holds for the kernel and for the fp32 torch reference alike.
    fo = grad_error_bound(*args)
    assert ((d.double() - d64).abs() <= ulp * d64.abs() + (1 + ulp) * fo + 1e-30).all()
    assert ((ref_grad(*args, torch.float32).double() - d64).abs() <= fo + 1e-30).all()


@interpreter_only
def test_inplace_matches_out_of_place_interpreter():
    x = make_logits(torch.float32)
    t = make_targets(x.size(0), 250)
    lse, g_logp, g_ent, pz = _grad_inputs(x, t, 250, 1 / 0.7, True)
    ref = logits_grad(x, t, 250, 1 / 0.7, lse, g_logp, g_ent, pz)
    y = x.clone()
    logits_grad(y, t, 250, 1 / 0.7, lse, g_logp, g_ent, pz, out=y)
    assert torch.equal(y, ref)


@interpreter_only
def test_strided_rows_and_empty_chunk_interpreter():
    """A row-strided view (a chunk of a wider buffer) and C = 0 work."""
    wide = make_logits(torch.float32, v=V_LOCAL + 7)
    x = wide[:, :V_LOCAL]
    t = make_targets(x.size(0), V_LOCAL)
    got = logits_row_stats(x, t, V_LOCAL, 1.0, True)
    want = logits_row_stats(x.contiguous(), t, V_LOCAL, 1.0, True)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    empty = torch.empty(0, V_LOCAL)
    m, s, zt, b = logits_row_stats(empty, torch.empty(0, dtype=torch.int64), V_LOCAL, 1.0, True)
    assert m.shape == s.shape == zt.shape == b.shape == (0,)
    z = torch.empty(0)
    assert logits_grad(empty, torch.empty(0, dtype=torch.int64), V_LOCAL, 1.0, z, z).shape == (
        0,
        V_LOCAL,
    )


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            dict(targets_local=torch.zeros(4, dtype=torch.int32)),
            "targets_local must be torch.int64",
        ),
        (dict(targets_local=torch.zeros(3, dtype=torch.int64)), r"targets_local must have shape"),
        (dict(n_valid=11), r"n_valid must be in \[0, V_local=10\]"),
        (dict(n_valid=-1), "n_valid must be in"),
        (dict(inv_temperature=0.0), "inv_temperature must be finite and > 0"),
        (dict(logits=torch.zeros(4, 10, dtype=torch.int32)), "logits must be float32"),
        (dict(logits=torch.zeros(10, 4).t()), "contiguous along the vocab"),
        (dict(logits=torch.zeros(40)), r"logits must be a 2-D \[C, V_local\] tensor"),
    ],
)
def test_row_stats_bad_input(kwargs, match):
    args = dict(
        logits=torch.zeros(4, 10),
        targets_local=torch.zeros(4, dtype=torch.int64),
        n_valid=10,
        inv_temperature=1.0,
        with_entropy=False,
    )
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        logits_row_stats(**args)


def test_grad_bad_input():
    x, t, f = torch.zeros(4, 10), torch.zeros(4, dtype=torch.int64), torch.zeros(4)
    with pytest.raises(ValueError, match="lse must be torch.float32"):
        logits_grad(x, t, 10, 1.0, f.double(), f)
    with pytest.raises(ValueError, match="grad_entropy and entropy_pz must be given together"):
        logits_grad(x, t, 10, 1.0, f, f, grad_entropy=f)
    with pytest.raises(ValueError, match=r"out must have the logits' shape"):
        logits_grad(x, t, 10, 1.0, f, f, out=torch.zeros(4, 11))
    shifted = x.view(torch.bfloat16)[:, 10:]  # shares memory, row r not at logits row r
    with pytest.raises(ValueError, match="out shares memory with logits"):
        logits_grad(x, t, 10, 1.0, f, f, out=shifted)


@pytest.mark.skipif(IN_INTERPRETER, reason="checks the compiled (non-interpreter) mode")
def test_cpu_tensors_rejected_when_compiled():
    with pytest.raises(ValueError, match="need CUDA tensors"):
        logits_row_stats(torch.zeros(2, 3), torch.zeros(2, dtype=torch.int64), 3, 1.0, False)


def test_import_without_triton(monkeypatch):
    """`import megatron_grpo.kernels` works without Triton; using a kernel names the fix."""
    monkeypatch.setattr(megatron_grpo, "kernels", megatron_grpo.kernels)
    for name in [n for n in sys.modules if n.startswith("megatron_grpo.kernels")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.setitem(sys.modules, "triton.language", None)
    fresh = importlib.import_module("megatron_grpo.kernels")
    assert not fresh.triton_available()
    with pytest.raises(RuntimeError, match="needs the `triton` package"):
        fresh.logits_row_stats(torch.zeros(2, 3), torch.zeros(2, dtype=torch.int64), 3, 1.0, False)


# --------------------------------------------------------------------------- GPU, full size

VOCAB, REAL_VOCAB = 151936, 151655  # Qwen-style padded vocab and its real size


def _gpu_case(rows, tp, rank, dtype, seed):
    """A [rows, V/tp] shard of full-size logits with the real-vocab padding of `rank`."""
    v_local = VOCAB // tp
    n_valid = max(0, min(v_local, REAL_VOCAB - rank * v_local))
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, v_local, device="cuda", generator=g) * 2.5
    x[: rows // 8] *= 8  # a slice of peaked rows
    x[1, :64] = 1e4
    x[2] = -1e4 + x[2] / 2.5
    targets = torch.randint(0, REAL_VOCAB, (rows,), device="cuda", generator=g)
    return x.to(dtype), targets - rank * v_local, n_valid


def _chunked(fn, *tensors, chunk=1024):
    outs = [fn(*(t[i : i + chunk] for t in tensors)) for i in range(0, tensors[0].size(0), chunk)]
    return [torch.cat(parts) for parts in zip(*outs, strict=True)]


def _gpu_stats(x, t, n_valid, inv_t, dtype):
    return _chunked(lambda xc, tc: ref_stats(xc, tc, n_valid, inv_t, dtype), x, t)


GPU_CASES = [  # rows, tp, rank, dtype
    (1024, 1, 0, torch.float32),
    (8192, 1, 0, torch.bfloat16),
    (4096, 2, 1, torch.float32),  # last TP2 shard: 281 padded columns
    (2048, 4, 3, torch.bfloat16),
]


@pytest.mark.gpu
@pytest.mark.parametrize("rows, tp, rank, dtype", GPU_CASES)
def test_kernels_gpu_full_size(rows, tp, rank, dtype):
    x, t, n_valid = _gpu_case(rows, tp, rank, dtype, seed=rows + tp)
    inv_t = 1 / 0.7
    m, s, zt, b = logits_row_stats(x, t, n_valid, inv_t, True)
    torch.cuda.synchronize()
    r64 = _gpu_stats(x, t, n_valid, inv_t, torch.float64)
    r32 = _gpu_stats(x, t, n_valid, inv_t, torch.float32)
    assert torch.equal(m, r32[0]) and torch.equal(zt, r32[2])
    for got, want32, want64 in zip(derived(m, s, zt, b), derived(*r32), derived(*r64), strict=True):
        assert scaled_err(got, want64) <= scaled_err(want32, want64) + 2e-6
    lse64, pz64 = derived(*r64)[0], derived(*r64)[2]
    g = torch.Generator(device="cuda").manual_seed(7)
    g_logp, g_ent = (torch.randn(rows, device="cuda", generator=g) for _ in range(2))
    lse, pz = lse64.float(), pz64.float()
    d = logits_grad(x, t, n_valid, inv_t, lse, g_logp, g_ent, pz)
    assert torch.isfinite(d).all() and not d[:, n_valid:].any()

    half_ulp = 0.0 if dtype == torch.float32 else torch.finfo(dtype).eps / 2

    def grad_err(xc, tc, dc, lc, gl, ge, pc):
        """Per chunk: worst ratio of the error (beyond round-to-nearest) to the first-order
        bound, for the kernel and for the fp32 torch reference."""
        args = (xc, tc, n_valid, inv_t, lc, gl, ge, pc)
        a = ref_grad(*args, torch.float64)
        a32 = ref_grad(*args, torch.float32)
        fo = (1 + half_ulp) * grad_error_bound(*args) + 1e-30
        excess = ((dc.double() - a).abs() - half_ulp * a.abs()) / fo
        return excess.max()[None], ((a32.double() - a).abs() / fo).max()[None]

    # Elementwise max(kernel error / bound) and the same for torch fp32: both must be <= 1. The
    # max error of one fp32 evaluation is not a bound for another's: at the |z| ~ 1e4 rows the
    # exponent is only known to ~1e-3 and each rounding sequence lands differently (see
    # grad_error_bound); the first run on an H200 had 8.8e-5 vs torch's 5.8e-5 there.
    kernel_ratio, torch_ratio = _chunked(grad_err, x, t, d, lse, g_logp, g_ent, pz)
    assert kernel_ratio.max().item() <= 1.0 and torch_ratio.max().item() <= 1.0


@pytest.mark.gpu
def test_kernels_gpu_autotune_inplace(monkeypatch):
    """The autotuned kernels give the default config's results, also writing d logits in place."""
    x, t, n_valid = _gpu_case(2048, 4, 3, torch.bfloat16, seed=3)
    want_stats = logits_row_stats(x, t, n_valid, 1.0, True)
    m, s, _, _ = want_stats
    lse, g_logp = m + torch.log(s), torch.randn(2048, device="cuda")
    want = logits_grad(x, t, n_valid, 1.0, lse, g_logp)
    monkeypatch.setenv("MEGATRON_GRPO_AUTOTUNE", "1")
    got_stats = logits_row_stats(x, t, n_valid, 1.0, True)
    y = x.clone()
    got = logits_grad(y, t, n_valid, 1.0, lse, g_logp, out=y)
    assert torch.equal(got_stats[0], m) and torch.equal(got_stats[2], want_stats[2])
    # Other tile sizes sum in another order; b = sum e z may be near 0, hence its atol.
    torch.testing.assert_close(got_stats[1], s, rtol=1e-5, atol=0)
    b_atol = 1e-5 * (s * (m.abs() + 1)).max().item()
    torch.testing.assert_close(got_stats[3], want_stats[3], rtol=1e-5, atol=b_atol)
    # Element-wise math: only a bf16 rounding right at a tie may differ.
    torch.testing.assert_close(got, want, rtol=torch.finfo(got.dtype).eps, atol=0)
