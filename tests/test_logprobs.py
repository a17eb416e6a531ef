"""vocab_parallel_logprobs at TP=1 and the torch kernel seam, against float64 full logits."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from megatron_grpo.ops import vocab_parallel_logprobs
from megatron_grpo.ops.lm_head.head import LMHead
from megatron_grpo.ops.lm_head.plan import TILE_FRACTION
from megatron_grpo.ops.lm_head.reference import logits_grad, logits_row_stats
from megatron_grpo.ops.lm_head.tiling import TILE_BYTES, Tiling

# ---------------------------------------------------------------- float64 reference helpers


def ref_logprobs(h, w, targets, *, temperature=1.0, vocab_size=None, rows=None):
    """float64 full-logits (logp [T], entropy [T]); 0 at rows=False. Differentiable."""
    vocab_size = w.shape[0] if vocab_size is None else vocab_size
    rows = torch.ones_like(targets, dtype=torch.bool) if rows is None else rows
    z = (h.double() @ w[:vocab_size].double().t()) / temperature
    logsm = z.log_softmax(-1)
    safe = torch.where(rows, targets, torch.zeros_like(targets))
    logp = logsm.gather(1, safe.unsqueeze(1)).squeeze(1)
    ent = -(logsm.exp() * logsm).sum(-1)
    zero = torch.zeros_like(logp)
    return torch.where(rows, logp, zero), torch.where(rows, ent, zero)


def make_inputs(t, h, v, *, dtype=torch.float32, seed=0, scale=2.0):
    """Random hidden [T, H], weight [V, H], targets [T]; logits of order `scale`."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(t, h, generator=g) * (scale / h**0.5)
    weight = torch.randn(v, h, generator=g) * 2.0
    targets = torch.randint(0, v, (t,), generator=g)
    return hidden.to(dtype), weight.to(dtype), targets


def upstream(t, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t, generator=g), torch.randn(t, generator=g)


def grads_of(fn, h, w, g_lp, g_ent):
    """(logp, ent, d_hidden, d_weight) of sum(logp * g_lp + ent * g_ent) for leaves h, w."""
    h = h.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    lp, ent = fn(h, w)
    (lp.double() * g_lp.double() + ent.double() * g_ent.double()).sum().backward()
    return lp.detach(), ent.detach(), h.grad, w.grad


def close(actual, expected, rtol=2e-5, atol=2e-6):
    torch.testing.assert_close(actual.double(), expected.double(), rtol=rtol, atol=atol)


def rel_err(x, ref):
    """Relative Frobenius-norm error."""
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


# ---------------------------------------------------------------- kernel seam (torch reference)


SEAM_TARGETS = torch.tensor([0, 3, -2, 10, 6, 25])  # in shard, or not (negative / too large)
INV_T = 1.25


def seam_logits(n_valid: int) -> torch.Tensor:
    logits = torch.randn(6, 11, generator=torch.Generator().manual_seed(3)) * 4
    logits[:, n_valid:] = 1e4  # padded columns: must never count
    return logits


@pytest.mark.parametrize("n_valid", [11, 7, 0])
def test_reference_row_stats(n_valid):
    logits = seam_logits(n_valid)
    m, s, zt, b = logits_row_stats(logits, SEAM_TARGETS, n_valid, INV_T, True)
    if n_valid == 0:  # empty shard: the identities of the TP combine, never NaN
        assert torch.isneginf(m).all() and (s == 0).all() and (zt == 0).all() and (b == 0).all()
        return
    z = logits[:, :n_valid].double() * INV_T
    close(m, z.amax(1))
    e = torch.exp(z - z.amax(1, keepdim=True))
    close(s, e.sum(1))
    close(b, (e * z).sum(1), rtol=1e-5, atol=1e-5)
    hit = (SEAM_TARGETS >= 0) & (SEAM_TARGETS < n_valid)
    col = torch.where(hit, SEAM_TARGETS, 0)
    close(zt, torch.where(hit, z.gather(1, col[:, None]).squeeze(1), 0.0))
    assert logits_row_stats(logits, SEAM_TARGETS, n_valid, INV_T, False)[3] is None


@pytest.mark.parametrize("n_valid", [11, 7, 0])
def test_reference_logits_grad(n_valid):
    """d logits of sum(g_lp * logp + g_ent * entropy) with this shard as the whole vocab; a
    target on another shard has a logit independent of these, so there logp = const - lse."""
    logits = seam_logits(n_valid)
    g = torch.Generator().manual_seed(4)
    g_lp, g_ent = torch.randn(6, generator=g), torch.randn(6, generator=g)
    x = logits.double().requires_grad_()
    z = x[:, :n_valid] * INV_T
    hit = (SEAM_TARGETS >= 0) & (SEAM_TARGETS < n_valid)
    if n_valid:
        logsm = z.log_softmax(-1)
        col = torch.where(hit, SEAM_TARGETS, 0)
        lp = torch.where(hit, logsm.gather(1, col[:, None]).squeeze(1), -z.logsumexp(-1))
        ent = -(logsm.exp() * logsm).sum(-1)
        (lp * g_lp.double() + ent * g_ent.double()).sum().backward()
    expected = x.grad if n_valid else torch.zeros_like(x)
    lse, pz = (z.logsumexp(-1).float(), (z.softmax(-1) * z).sum(-1).float()) if n_valid else (
        torch.full((6,), float("-inf")), torch.zeros(6))  # fmt: skip
    args = (SEAM_TARGETS, n_valid, INV_T, lse.detach(), g_lp, g_ent, pz.detach())
    close(logits_grad(logits, *args), expected, rtol=1e-5, atol=1e-6)
    bf16 = logits_grad(logits, *args, out=torch.empty(6, 11, dtype=torch.bfloat16))
    assert bf16.dtype == torch.bfloat16
    close(bf16, expected, rtol=1e-2, atol=1e-3)
    same = logits.clone()  # in place over the logits
    close(logits_grad(same, *args, out=same), expected, rtol=1e-5, atol=1e-6)
    no_ent = logits_grad(logits, *args[:5])  # entropy term off
    assert not torch.allclose(no_ent, logits_grad(logits, *args)) or n_valid == 0


# ---------------------------------------------------------------- the op at TP = 1


CASES = [
    # (T, H, V, vocab_size, temperature, chunk_size, masked, entropy)
    (13, 16, 37, None, 1.0, None, False, False),
    (13, 16, 37, None, 0.7, 5, False, True),  # chunk does not divide T
    (17, 8, 40, 33, 1.3, 4, True, True),  # padded vocab + masked rows
    (9, 8, 25, 25, 2.0, 1, True, False),
]


@pytest.mark.parametrize("t,h,v,vocab_size,temperature,chunk,masked,entropy", CASES)
def test_tp1_matches_float64(t, h, v, vocab_size, temperature, chunk, masked, entropy):
    hidden, weight, targets = make_inputs(t, h, v)
    if vocab_size is not None:
        weight[vocab_size:] = 50.0  # padded rows would dominate the softmax if counted
        targets = targets % vocab_size
    rows = None
    if masked:
        rows = torch.arange(t) % 3 != 0
        targets = torch.where(rows, targets, torch.full_like(targets, -100))
    g_lp, g_ent = upstream(t)
    g_ent = g_ent if entropy else torch.zeros_like(g_ent)

    def ours(hh, ww):
        out = vocab_parallel_logprobs(
            hh, ww, targets, temperature=temperature, vocab_size=vocab_size,
            return_entropy=entropy, chunk_size=chunk, impl="torch", rows=rows,
        )  # fmt: skip
        return out if entropy else (out, torch.zeros_like(out))

    def ref(hh, ww):
        return ref_logprobs(hh, ww, targets, temperature=temperature, vocab_size=vocab_size,
                            rows=rows)  # fmt: skip

    lp, ent, dh, dw = grads_of(ours, hidden, weight, g_lp, g_ent)
    lp64, ent64, dh64, dw64 = grads_of(ref, hidden, weight, g_lp, g_ent)
    assert lp.dtype == torch.float32 and lp.shape == (t,)
    close(lp, lp64)
    if entropy:  # lse - sum p z cancels: fp32 error ~ eps * max|z|
        close(ent, ent64, atol=1e-5)
    close(dh, dh64, rtol=1e-4, atol=1e-5)
    close(dw, dw64, rtol=1e-4, atol=1e-5)
    if masked:
        assert (lp[~rows] == 0).all() and (dh[~rows] == 0).all()
    if vocab_size is not None:
        assert (dw[vocab_size:] == 0).all()


def test_bf16_error_bounded_by_bf16_torch_reference():
    """bf16 inputs: error vs float64 (same bf16 values) <= that of the bf16 materialized path."""
    t, h, v, temperature = 32, 64, 96, 0.8
    hidden, weight, targets = make_inputs(t, h, v, dtype=torch.bfloat16, scale=8.0)
    g_lp, g_ent = upstream(t)

    def ours(hh, ww):
        return vocab_parallel_logprobs(
            hh,
            ww,
            targets,
            temperature=temperature,
            return_entropy=True,
            chunk_size=7,
            impl="torch",
        )

    def bf16_materialized(hh, ww):
        logsm = ((hh @ ww.t()).float() / temperature).log_softmax(-1)
        return logsm.gather(1, targets[:, None]).squeeze(1), -(logsm.exp() * logsm).sum(-1)

    def truth(hh, ww):
        return ref_logprobs(hh, ww, targets, temperature=temperature)

    res = grads_of(ours, hidden, weight, g_lp, g_ent)
    mat = grads_of(bf16_materialized, hidden, weight, g_lp, g_ent)
    exact = grads_of(truth, hidden.double(), weight.double(), g_lp, g_ent)
    assert res[2].dtype == torch.bfloat16 and res[3].dtype == torch.bfloat16
    lp_err = (res[0] - exact[0]).abs().max().item()
    assert lp_err <= 1e-4  # fp32 logits: far below bf16 logit rounding
    assert lp_err <= (mat[0] - exact[0]).abs().max().item() + 1e-5
    for i in (1, 2, 3):  # entropy, d_hidden, d_weight
        err = rel_err(res[i], exact[i])
        assert err <= rel_err(mat[i], exact[i]) + 1e-4, i
        # Gradients: bf16 output rounding plus bf16 d logits, at most twice the rounding alone.
        assert err <= 2 * rel_err(exact[i].to(torch.bfloat16), exact[i]), i


@pytest.mark.parametrize("mode", ["main_grad", "megatron_ddp", "tied_embedding"])
def test_main_grad_accumulation(mode):
    """weight.main_grad (fp32) receives dW on top of its content. Under Megatron DDP autograd
    gets a dummy grad (so the grad-ready hook fires): zeros for a tied embedding weight
    (``zero_out_wgrad``), whose other use's grad the hook then adds to main_grad."""
    hidden, weight, targets = make_inputs(10, 8, 21)
    g_lp, _ = upstream(10)
    expected = grads_of(lambda a, b: ref_logprobs(a, b, targets), hidden, weight, g_lp, g_lp * 0)
    w = weight.clone().requires_grad_()
    w.main_grad = torch.full(w.shape, 0.5)
    if mode != "main_grad":
        w.grad_added_to_main_grad = False
    if mode == "tied_embedding":
        w.zero_out_wgrad = True
    lp = vocab_parallel_logprobs(hidden, w, targets, chunk_size=3, impl="torch")
    embedding_use = (w[targets[:4]] * 0.25).sum() if mode == "tied_embedding" else 0.0
    ((lp * g_lp).sum() + embedding_use).backward()
    close(w.main_grad - 0.5, expected[3], rtol=1e-4, atol=1e-5)
    if mode == "main_grad":
        assert w.grad is None
        return
    assert w.grad_added_to_main_grad is True and w.grad is not None
    if mode == "tied_embedding":  # the embedding's gradient alone, exactly
        other = torch.zeros_like(w).index_add_(0, targets[:4], torch.full((4, 8), 0.25))
        assert torch.equal(w.grad, other)


def test_entropy_only_backward_and_no_grad():
    hidden, weight, targets = make_inputs(8, 8, 19)
    _, g_ent = upstream(8)
    ours = grads_of(
        lambda a, b: vocab_parallel_logprobs(a, b, targets, return_entropy=True, impl="torch"),
        hidden, weight, g_ent * 0, g_ent,
    )  # fmt: skip
    h = hidden.clone().requires_grad_()
    _, ent = vocab_parallel_logprobs(h, weight, targets, return_entropy=True, impl="torch")
    (ent * g_ent).sum().backward()  # grad_logp is None inside the Function
    close(h.grad, ours[2])
    with torch.no_grad():
        lp = vocab_parallel_logprobs(hidden.requires_grad_(), weight, targets, impl="torch")
    assert lp.grad_fn is None


def _spy_tiles(monkeypatch) -> list[tuple[int, int, int]]:
    """Records (rows, first vocab row, vocab rows) of every logits tile GEMM."""
    seen: list[tuple[int, int, int]] = []
    original = LMHead.logits

    def spy(self, h, start, stop, buf):
        seen.append((h.shape[0], start, stop - start))
        return original(self, h, start, stop, buf)

    monkeypatch.setattr(LMHead, "logits", spy)
    return seen


def test_chunking_bounds_logits_and_skips_inactive_rows(monkeypatch):
    """Every logits GEMM has <= chunk rows; only active rows are computed; backward recomputes."""
    seen = _spy_tiles(monkeypatch)
    hidden, weight, targets = make_inputs(23, 8, 30)
    rows = torch.zeros(23, dtype=torch.bool)
    rows[5:16] = True  # 11 active rows
    h = hidden.clone().requires_grad_()
    lp = vocab_parallel_logprobs(h, weight, targets, chunk_size=4, impl="torch", rows=rows)
    assert seen == [(4, 0, 30), (4, 0, 30), (3, 0, 30)]
    lp.sum().backward()
    assert seen == [(4, 0, 30), (4, 0, 30), (3, 0, 30)] * 2


def test_tiling_plan():
    """Square default tiles within the budget, fewer rows for short inputs, vocab remainder."""
    side = int((TILE_BYTES // 4) ** 0.5)
    big = Tiling.plan(4 * side + 5, 151655, None)
    assert (big.rows, big.cols) == (side, side) and big.rows * big.cols * 4 <= TILE_BYTES
    assert big.row_blocks()[-1] == (4 * side, 4 * side + 5)
    assert big.col_tiles()[-1] == (151655 // side * side, 151655)
    short = Tiling.plan(1000, 151655, None)
    assert short.rows == 1024 and short.cols * short.rows * 4 <= TILE_BYTES
    assert short.cols % 256 == 0 and short.row_blocks() == [(0, 1000)]
    assert Tiling.plan(100, 151655, None).cols == 151655  # a few rows: the whole shard
    assert Tiling.plan(10, 37, 4).cols == 37  # the whole shard fits: one vocab tile
    assert Tiling.plan(10, 0, None).col_tiles() == []  # all-padded shard: nothing to compute


TILED = [  # (T, V, vocab_size, chunk, tile elements, dtype, main_grad dtype, masked, entropy)
    (23, 45, 41, 4, 32, torch.float32, None, True, True),  # fp32 grad: rows outer
    (23, 45, 41, 5, 40, torch.bfloat16, None, False, True),  # bf16 grad: vocab outer
    (19, 40, 40, 3, 21, torch.bfloat16, torch.float32, True, False),  # main_grad: rows outer
    (19, 40, 37, 8, 48, torch.bfloat16, torch.bfloat16, False, True),  # bf16 main_grad
    (12, 40, 37, 16, 48, torch.bfloat16, None, True, True),  # one row block: GEMM into grad
]


@pytest.mark.parametrize("t,v,vocab_size,chunk,elems,dtype,mg,masked,entropy", TILED)
def test_2d_tiles_match_float64(
    monkeypatch, t, v, vocab_size, chunk, elems, dtype, mg, masked, entropy
):
    """Vocab tiles that do not divide the vocabulary (nor the rows the chunk): values and both
    gradients against float64, padded rows never computed, and the backward loop order that
    keeps the fp32 accumulators small (rows outer iff d_weight accumulates in place in fp32).
    The tile of ``elems`` fp32 values is the memory budget's share (``memory_budget``)."""
    seen = _spy_tiles(monkeypatch)
    hidden, weight, targets = make_inputs(t, 16, v, dtype=dtype, scale=4.0)
    weight[vocab_size:] = 50.0
    targets = targets % vocab_size
    rows = (torch.arange(t) % 4 != 1) if masked else None
    g_lp, g_ent = upstream(t)
    g_ent = g_ent if entropy else torch.zeros_like(g_ent)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    if mg is not None:
        w.main_grad = torch.full(w.shape, 0.25, dtype=mg)
    out = vocab_parallel_logprobs(h, w, targets, temperature=0.9, vocab_size=vocab_size,
                                  return_entropy=entropy, chunk_size=chunk, impl="torch",
                                  rows=rows, memory_budget=TILE_FRACTION * 4 * elems)  # fmt: skip
    lp, ent = out if entropy else (out, torch.zeros_like(out))
    n_fwd = len(seen)
    (lp.double() * g_lp.double() + ent.double() * g_ent.double()).sum().backward()
    dw = w.grad if mg is None else w.main_grad - 0.25
    exact = grads_of(
        lambda a, b: ref_logprobs(a, b, targets, temperature=0.9, vocab_size=vocab_size,
                                  rows=rows),
        hidden.double(), weight.double(), g_lp, g_ent,
    )  # fmt: skip
    n_active = t if rows is None else int(rows.sum())
    cols = min(elems // chunk, vocab_size)
    assert {c for _, _, c in seen} == {cols, vocab_size % cols or cols}
    assert all(r <= chunk and v0 + c <= vocab_size for r, v0, c in seen)
    assert sum(r * c for r, _, c in seen[:n_fwd]) == n_active * vocab_size  # each logit once
    if n_active > chunk:  # second backward tile: the next vocab tile (same rows) or rows
        rows_outer = seen[n_fwd + 1][1] != 0
        assert rows_outer == (dtype == torch.float32 or mg == torch.float32)
    close(lp, exact[0], rtol=1e-5, atol=1e-5)
    if entropy:
        close(ent, exact[1], rtol=1e-4, atol=1e-4)
    if dtype == torch.float32:
        close(h.grad, exact[2], rtol=1e-4, atol=1e-5)
        close(dw, exact[3], rtol=1e-4, atol=1e-5)
    else:  # bf16 d logits and outputs: a few bf16 roundings
        for got, want in ((h.grad, exact[2]), (dw, exact[3])):
            assert rel_err(got, want) <= 3 * rel_err(want.to(torch.bfloat16), want) + 1e-3
    assert (dw[vocab_size:] == 0).all()


def test_bad_inputs_raise_clear_errors():
    hidden, weight, targets = make_inputs(6, 8, 10)
    bad = targets.clone()
    bad[2] = 10
    with pytest.raises(ValueError, match=r"targets\[2\] = 10"):
        vocab_parallel_logprobs(hidden, weight, bad, impl="torch")
    rows = torch.ones(6, dtype=torch.bool)
    rows[2] = False  # the same bad target is fine at an inactive row
    assert vocab_parallel_logprobs(hidden, weight, bad, impl="torch", rows=rows)[2] == 0
    with pytest.raises(ValueError, match="vocab_size"):
        vocab_parallel_logprobs(hidden, weight, targets, vocab_size=11)
    with pytest.raises(ValueError, match="targets has 5 rows"):
        vocab_parallel_logprobs(hidden, weight, targets[:5])
    with pytest.raises(ValueError, match="rows must be a bool"):
        vocab_parallel_logprobs(hidden, weight, targets, rows=rows.long())
    with pytest.raises(ValueError, match="temperature"):
        vocab_parallel_logprobs(hidden, weight, targets, temperature=0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        vocab_parallel_logprobs(hidden, weight, targets, chunk_size=0)
    with pytest.raises(ValueError, match="impl"):
        vocab_parallel_logprobs(hidden, weight, targets, impl="cuda")
    with pytest.raises(ValueError, match="dtype"):
        vocab_parallel_logprobs(hidden, weight.double(), targets)


_INTERPRETER_SCRIPT = """
import torch
from megatron_grpo.ops import vocab_parallel_logprobs
from tests.test_logprobs import close, make_inputs
for dtype in (torch.float32, torch.bfloat16):
    hidden, weight, targets = make_inputs(11, 8, 40, dtype=dtype)
    weight[37:] = 50.0
    rows = torch.arange(11) % 4 != 2
    targets = torch.where(rows, targets % 37, -100)
    out = []
    for impl in ("triton", "torch"):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        lp, ent = vocab_parallel_logprobs(h, w, targets, temperature=0.8, vocab_size=37,
                                          return_entropy=True, chunk_size=4, impl=impl, rows=rows)
        (lp * torch.linspace(-1, 1, 11) + ent).sum().backward()
        out.append((lp, ent, h.grad.float(), w.grad.float()))
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    for a, b in zip(*out):  # bf16 gradients: one rounding step apart at most
        close(a.detach(), b.detach(), **tol)
print("ok")
"""


@pytest.mark.slow
def test_triton_impl_matches_torch_in_interpreter():
    """impl="triton" through the whole op (CPU, TRITON_INTERPRET=1 in a fresh process)."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", _INTERPRETER_SCRIPT], env=env, cwd=root,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-4000:]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="interpreter allowed")
def test_triton_impl_on_cpu_needs_interpreter():
    hidden, weight, targets = make_inputs(4, 8, 10)
    with pytest.raises((ValueError, ImportError), match="triton"):
        vocab_parallel_logprobs(hidden, weight, targets, impl="triton")


# ---------------------------------------------------------------- GPU (run on a GPU machine)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_gpu_bf16_accuracy_and_memory(impl):
    """bf16 on CUDA: fp32-logit accuracy against an fp64 GEMM of the same bf16 inputs, and the
    extra memory of forward + backward stays O(chunk x V), not O(T x V)."""
    dev = torch.device("cuda")
    t, h, v, chunk = 4096, 1024, 32000, 512
    hidden, weight, targets = make_inputs(t, h, v, dtype=torch.bfloat16, scale=3.0)
    hidden, weight, targets = hidden.to(dev).requires_grad_(), weight.to(dev), targets.to(dev)
    weight.requires_grad_()
    weight.main_grad = torch.zeros(v, h, device=dev)
    g_lp, g_ent = (x.to(dev) for x in upstream(t))
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    lp, ent = vocab_parallel_logprobs(
        hidden, weight, targets, temperature=0.9, return_entropy=True, chunk_size=chunk, impl=impl
    )
    (lp * g_lp + ent * g_ent).sum().backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    # d_hidden fp32 + bf16, [T] vectors, and a handful of [chunk, V] fp32 buffers.
    bound = t * h * 6 + 64 * t * 4 + 6 * chunk * v * 4 + 2**24
    assert extra <= bound, (extra / 2**20, bound / 2**20)
    assert extra < t * v * 4  # far below one materialized fp32 [T, V] logits tensor

    with torch.no_grad():
        z = (hidden.double() @ weight.double().t()) / 0.9
    z.requires_grad_()
    logsm = z.log_softmax(-1)
    lp64 = logsm.gather(1, targets[:, None]).squeeze(1)
    ent64 = -(logsm.exp() * logsm).sum(-1)
    (lp64 * g_lp.double() + ent64 * g_ent.double()).sum().backward()
    dz = z.grad / 0.9
    dh64, dw64 = dz @ weight.double(), dz.t() @ hidden.double()
    errs = [(lp.double() - lp64).abs().max().item(), (ent.double() - ent64).abs().max().item()]
    errs += [rel_err(hidden.grad, dh64), rel_err(weight.main_grad, dw64)]
    rounding = [rel_err(x.to(torch.bfloat16), x) for x in (dh64, dw64)]
    print(f"{impl}: logp/entropy max abs {errs[:2]}, grad rel {errs[2:]}, bf16 rounding {rounding}")
    assert errs[0] <= 1e-4 and errs[1] <= 1e-3, errs
    assert errs[2] <= 3 * rounding[0] and errs[3] <= 3 * rounding[1], (errs, rounding)


@pytest.mark.gpu
@pytest.mark.parametrize("main_grad", [True, False])
def test_gpu_tiled_memory(main_grad):
    """Default 2D tiles at a size with several vocab tiles: the extra memory of forward +
    backward beyond the gradients is one logits tile plus the accumulators: an fp32 [R, H]
    d_hidden block with an fp32 main_grad; without, an fp32 [T, H] d_hidden and one fp32
    [Vc, H] d_weight tile. Never a [V, H] fp32 accumulator."""
    dev = torch.device("cuda")
    t, h, v = 4096, 1024, 65536
    hidden, weight, targets = make_inputs(t, h, v, dtype=torch.bfloat16)
    hidden, weight, targets = hidden.to(dev).requires_grad_(), weight.to(dev), targets.to(dev)
    weight.requires_grad_()
    if main_grad:
        weight.main_grad = torch.zeros(v, h, device=dev)
    plan = Tiling.plan(t, v, None)
    assert plan.cols < v  # several vocab tiles
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    lp = vocab_parallel_logprobs(hidden, weight, targets, return_entropy=False, impl="triton")
    lp.sum().backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    grads = hidden.grad.nbytes + (0 if main_grad else weight.grad.nbytes)
    acc = plan.rows * h * 4 if main_grad else t * h * 4 + plan.cols * h * 4
    bound = grads + plan.rows * plan.cols * 4 + acc + 64 * t * 4 + 2**24
    assert extra <= bound, (extra / 2**20, bound / 2**20)
