"""fused_grpo_loss == grpo_loss(vocab_parallel_logprobs(...)): loss, metrics, log-probs, entropy
and gradients, on both token-ratio paths (single pass / tiled recompute, chosen with ``path=``)
and for GSPO (sequence ratio: the tiled path, the plan's choice), at TP=1 (in process) and TP=2
with and without sequence parallelism (spawned); the plan's rule that picks the path."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from megatron_grpo.loss import GRPOLossConfig, grpo_loss
from megatron_grpo.ops import fused_grpo_loss, fused_grpo_loss_plan, vocab_parallel_logprobs
from megatron_grpo.ops.lm_head import tiling as tiling_mod
from megatron_grpo.ops.lm_head.head import LMHead
from megatron_grpo.ops.lm_head.plan import (
    SINGLE_PASS_MIN_ROWS,
    TILE_FRACTION,
    HeadShape,
    plan_lm_head,
    weight_grad_mode,
)
from tests.dist_utils import run_distributed
from tests.host_syncs import cuda_host_syncs
from tests.test_logprobs import close, make_inputs

T, H, V, VOCAB = 30, 16, 40, 37  # V = padded rows of the full weight
CU = torch.tensor([0, 10, 18, 30])
PROMPT = (4, 3, 5)  # leading prompt tokens of each sequence
N_ROWS = T - sum(PROMPT)  # loss rows

CONFIGS = {
    "token_full": dict(kl_coef=0.05, entropy_coef=0.01, dual_clip_c=3.0,
                       is_correction_level="token", is_truncate=2.0),
    "token_plain": dict(loss_agg="seq_mean_token_sum_norm", max_response_length=12),
    "gspo": dict(ratio_level="sequence", loss_agg="seq_mean_token_mean", kl_coef=0.05,
                 entropy_coef=0.02, clip_eps_low=3e-4, clip_eps_high=4e-4),
}  # fmt: skip
PATHS = ("single", "tiled")
FUSED = {"single": "fused_single_pass", "tiled": "fused_tiled", None: None}  # path= of each


def ran_path(loss: torch.Tensor) -> str:
    """Which path built ``loss``: "single", "tiled" (the fused autograd Functions) or "op"."""
    name = type(loss.grad_fn).__name__
    return {"_SinglePassTokenGRPOBackward": "single", "_TiledTokenGRPOBackward": "tiled"}.get(
        name, "op"
    )


def loss_batch(hidden, weight_full, temperature, vocab=VOCAB):
    """Targets, mask and policy-independent loss inputs around the current policy."""
    g = torch.Generator().manual_seed(7)
    mask = torch.ones(T, dtype=torch.bool)
    for start, n in zip(CU[:-1].tolist(), PROMPT, strict=True):
        mask[start : start + n] = False
    targets = torch.randint(0, vocab, (T,), generator=g)
    targets = torch.where(mask, targets, torch.full_like(targets, -100))
    with torch.no_grad():
        logp = vocab_parallel_logprobs(
            hidden.float(), weight_full[:vocab].float(), targets, temperature=temperature,
            rows=mask, impl="torch",
        )  # fmt: skip
    noise = torch.randn(3, T, generator=g) * 0.3
    seq_adv = torch.randn(len(PROMPT), generator=g)
    batch = dict(
        old_logprobs=logp + noise[0], ref_logprobs=logp + noise[1],
        rollout_logprobs=logp + noise[0] + 0.1 * noise[2],
        advantages=seq_adv.repeat_interleave(CU.diff()), loss_mask=mask, cu_seqlens=CU,
    )  # fmt: skip
    return targets, batch


def metric_values(metrics) -> dict[str, float]:
    out = {}
    for k, m in metrics.items():
        if hasattr(m, "count"):
            out[k] = float(m.sum) / float(m.count)
        else:
            out[k] = float(m.sum if hasattr(m, "sum") else m.value)
    return out


def _leaf(x, main_grad: torch.dtype | None):
    x = x.detach().clone().requires_grad_()
    if main_grad is not None:
        x.main_grad = torch.full(x.shape, 0.5, dtype=main_grad)
        x.grad_added_to_main_grad = False
    return x


def run_both(cfg, h, w, targets, batch, *, scale=1.0, main_grad=None, path=None, **op):
    """(loss, metrics, logp, ent, d_hidden, d_weight, path that ran) of the fused path (``path``:
    "single", "tiled" or None = the plan's choice) and of the reference ("ref"); d_weight =
    main_grad - 0.5 with an initial ``main_grad`` of 0.5 (dtype ``main_grad``)."""
    results = []
    for fused in (True, False):
        hh, ww = h.detach().clone().requires_grad_(), _leaf(w, main_grad)
        if fused:
            loss, met, lp, ent = fused_grpo_loss(hh, ww, targets, cfg, return_entropy=True,
                                                 path=FUSED[path], **batch, **op)  # fmt: skip
        else:
            lp, ent = vocab_parallel_logprobs(hh, ww, targets, rows=batch["loss_mask"],
                                              return_entropy=True, **op)  # fmt: skip
            loss, met = grpo_loss(cfg, logprobs=lp, entropy=ent, **batch)
        (loss * scale).backward()
        dw = ww.grad if main_grad is None else ww.main_grad.float() - 0.5
        if main_grad is not None:
            assert ww.grad_added_to_main_grad
        ran = ran_path(loss) if fused else "ref"
        results.append((loss.detach(), metric_values(met), lp.detach(), ent.detach(), hh.grad,
                        dw, ran))  # fmt: skip
    return results


def assert_same(fused, ref, grads=True):
    close(fused[0], ref[0], rtol=1e-5, atol=1e-7)
    assert fused[1].keys() == ref[1].keys()
    for k in ref[1]:
        a, b = fused[1][k], ref[1][k]
        assert (math.isnan(a) and math.isnan(b)) or math.isclose(
            a, b, rel_tol=1e-5, abs_tol=1e-6
        ), k
    close(fused[2], ref[2])
    close(fused[3], ref[3], atol=1e-5)
    if grads:
        close(fused[4], ref[4], rtol=1e-4, atol=1e-6)
        close(fused[5], ref[5], rtol=1e-4, atol=1e-6)


def assert_bf16_grads(fused, ref, dw_ulp=0.0):
    """bf16: both round d logits to bf16 (the single pass before applying grad_output);
    ``dw_ulp``: the spacing of a bf16 main_grad's values (each path rounds into it once)."""
    assert_same(fused, ref, grads=False)
    for i, extra in ((4, 0.0), (5, dw_ulp)):
        close(fused[i], ref[i], rtol=2e-2, atol=1e-2 * ref[i].abs().max().item() + extra)


# path None: the plan's choice (GSPO: tiled)
CASES = [(n, p) for n in ("token_full", "token_plain") for p in PATHS]
CASES += [("gspo", None), ("gspo", "tiled")]


@pytest.mark.parametrize(("name", "path"), CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_matches_grpo_loss_tp1(name, path, dtype):
    """Masked prompt rows, padded vocabulary (padded rows of weight 50), temperature, entropy
    bonus (token_full), grad_output 2.5, several chunks on each path."""
    cfg = GRPOLossConfig(**CONFIGS[name])
    hidden, weight, _ = make_inputs(T, H, V, dtype=dtype)
    weight[VOCAB:] = 50.0
    targets, batch = loss_batch(hidden, weight, 0.8)
    op = dict(temperature=0.8, vocab_size=VOCAB, chunk_size=7, impl="torch")
    fused, ref = run_both(cfg, hidden, weight, targets, batch, scale=2.5, path=path, **op)
    assert fused[6] == (path or "tiled")
    if dtype == torch.float32:
        assert_same(fused, ref)
        assert fused[1]["loss/pg_clipfrac_high"] + fused[1]["loss/pg_clipfrac_low"] > 0
    else:
        assert_bf16_grads(fused, ref)
    assert (fused[2][~batch["loss_mask"]] == 0).all() and (fused[4][~batch["loss_mask"]] == 0).all()


# (weight dtype, main_grad dtype): Megatron's fp32 buffer, fp32 weight, a low-precision buffer
MAIN_GRADS = [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
              (torch.bfloat16, torch.bfloat16)]  # fmt: skip


@pytest.mark.parametrize(("name", "path"), [("token_full", p) for p in PATHS] + [("gspo", None)])
@pytest.mark.parametrize(("w_dtype", "mg_dtype"), MAIN_GRADS)
@pytest.mark.parametrize("scale", [1.0, 3.0])
def test_fused_main_grad(name, path, w_dtype, mg_dtype, scale):
    """d_weight accumulates onto an existing main_grad, scaled by grad_output (the single pass
    writes it in forward and corrects a grad_output != 1 in backward; GSPO runs tiled)."""
    cfg = GRPOLossConfig(**CONFIGS[name])
    hidden, weight, _ = make_inputs(T, H, V, dtype=w_dtype)
    targets, batch = loss_batch(hidden, weight, 1.0)
    op = dict(vocab_size=VOCAB, chunk_size=5, impl="torch", main_grad=mg_dtype)
    fused, ref = run_both(cfg, hidden, weight, targets, batch, scale=scale, path=path, **op)
    assert fused[6] == (path or "tiled")
    if w_dtype == torch.float32:
        assert_same(fused, ref)
    else:  # a bf16 main_grad holds 0.5 + d_weight in steps of 2^-8
        assert_bf16_grads(fused, ref, dw_ulp=2.0**-8 if mg_dtype == torch.bfloat16 else 0.0)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("with_main_grad", [False, True])
def test_fused_gemm_schedule(monkeypatch, path, with_main_grad):
    """Logits only for loss rows, chunk_size rows per tile. Single pass: full-width tiles in the
    forward only (3 GEMMs) while grad_output is 1, a recompute pass for the main_grad correction
    otherwise; tiled: one stats pass in forward, one recompute pass in backward."""
    seen: list[tuple[int, int]] = []
    original = LMHead.logits

    def spy(self, h, start, stop, buf):
        seen.append((h.shape[0], stop - start))
        return original(self, h, start, stop, buf)

    monkeypatch.setattr(LMHead, "logits", spy)
    hidden, weight, _ = make_inputs(T, H, V)
    targets, batch = loss_batch(hidden, weight, 1.0)
    one_pass = [(8, VOCAB)] * (N_ROWS // 8) + [(N_ROWS % 8, VOCAB)]
    for scale in (1.0, 2.0):
        seen.clear()
        w = _leaf(weight, torch.float32 if with_main_grad else None)
        loss, _, _ = fused_grpo_loss(hidden, w, targets, GRPOLossConfig(), chunk_size=8,
                                     vocab_size=VOCAB, impl="torch", path=FUSED[path],
                                     **batch)  # fmt: skip
        assert ran_path(loss) == path and seen == one_pass
        (scale * loss).backward()
        recompute = path == "tiled" or (with_main_grad and scale != 1.0)
        assert seen == one_pass * (2 if recompute else 1)


def test_single_pass_second_backward_and_no_grad():
    """retain_graph: a second backward adds the gradients again (by recompute); no_grad: loss
    and log-probs only (the stats pass), equal to the reference."""
    cfg = GRPOLossConfig(**CONFIGS["token_full"])
    hidden, weight, _ = make_inputs(T, H, V)
    targets, batch = loss_batch(hidden, weight, 1.0)
    op = dict(vocab_size=VOCAB, chunk_size=6, impl="torch")
    expected = run_both(cfg, hidden, weight, targets, batch, scale=3.0, **op)[1]
    op["path"] = "fused_single_pass"
    for main_grad in (None, torch.float32):
        h, w = hidden.clone().requires_grad_(), _leaf(weight, main_grad)
        loss, _, _ = fused_grpo_loss(h, w, targets, cfg, **batch, **op)
        (2.0 * loss).backward(retain_graph=True)
        loss.backward()
        assert ran_path(loss) == "single"
        close(h.grad, expected[4], rtol=1e-4, atol=1e-6)
        close(w.grad if main_grad is None else w.main_grad - 0.5, expected[5], 1e-4, 1e-6)
    with torch.no_grad():
        loss, _, lp = fused_grpo_loss(hidden, weight, targets, cfg, **batch, **op)
        plan = fused_grpo_loss_plan(hidden, weight, targets, cfg, **batch, **op)
    assert plan.path == "fused_tiled" and "no gradient" in plan.reason
    close(loss, expected[0], rtol=1e-5, atol=1e-7)
    close(lp, expected[2])


def rule(n_rows, v_local, hidden, chunk_size=None, main_grad=torch.float32, **kw) -> int | None:
    """Rows per single-pass chunk the plan picks for a bf16 shard with a ``main_grad`` of that
    dtype (None: d_weight summed as bf16 + int8 residual; bf16: in an fp32 buffer), None =
    tiled path."""
    shape = HeadShape(n_rows, v_local, v_local, hidden, torch.bfloat16, main_grad, "cuda")
    plan = plan_lm_head(shape, loss=GRPOLossConfig(), impl="torch", chunk_size=chunk_size, **kw)
    assert (plan.path == "fused_single_pass") == (plan.chunk_rows is not None)
    return plan.chunk_rows


def test_single_pass_default_threshold_follows_the_measurements():
    """The measured H200 cases (V = 151936, H = 4096, TP = 1 and TP = 4 with an fp32 main_grad)
    were faster on the tiled path: the default rule must pick it there."""
    for tp in (1, 4):
        assert rule(8192, 151936 // tp, 4096) is None
    assert rule(8192, 16384, 4096) == 4096 == SINGLE_PASS_MIN_ROWS["separate"]


def test_single_pass_rule():
    """The documented rule at V = 151936, H = 4096 (an fp32 main_grad; without one the int8
    residual, with a bf16 one an fp32 buffer, of at most one tile); explicit chunk_size; the
    threshold; small batches."""
    low = dict(single_pass_min_rows=1024)
    tile_rows = {1: 384, 2: 832, 4: 1728, 8: 3520}  # full-width 256 MiB rows, 64-aligned
    for tp, rows in tile_rows.items():
        v_local = 151936 // tp
        assert rows * v_local * 4 <= tiling_mod.TILE_BYTES < (rows + 64) * v_local * 4
        assert rule(8192, v_local, 4096, **low) == (rows if rows >= 1024 else None)
        residual_fits = v_local * 4096 <= tiling_mod.TILE_BYTES  # TP >= 4
        assert rule(8192, v_local, 4096, main_grad=None, **low) == (
            rows if residual_fits and rows >= 1024 else None
        )
        assert rule(8192, v_local, 4096, main_grad=torch.bfloat16, **low) is None
        assert rule(300, v_local, 4096, **low) == (300 if rows >= 300 else None)
    assert rule(8192, 151936 // 8, 2048, main_grad=torch.bfloat16, **low) == 3520
    assert rule(8192, 18992, 4096, 2048, **low) == 2048
    assert rule(8192, 18992, 4096, 1000, **low) is None  # below the threshold
    assert rule(8192, 18992, 4096, 4096, **low) is None  # does not fit a tile
    assert rule(0, 18992, 4096, **low) is None
    w = torch.zeros(2, 2, dtype=torch.bfloat16)
    modes = [weight_grad_mode(HeadShape.of(x, rows=1, want_dw=True)) for x in (w, w.float())]
    assert modes == ["write_tiles", "accumulate_fp32"]
    w.main_grad = torch.zeros(2, 2)
    assert weight_grad_mode(HeadShape.of(w, rows=1, want_dw=True)) == "accumulate_fp32"
    w.main_grad = torch.zeros(2, 2, dtype=torch.bfloat16)
    assert weight_grad_mode(HeadShape.of(w, rows=1, want_dw=True)) == "add_tiles"
    assert weight_grad_mode(HeadShape.of(w, rows=1)) == "none"  # no requires_grad


@pytest.mark.parametrize(
    ("w_dtype", "mg_dtype", "weight_grad", "expected"),
    [(torch.bfloat16, None, True, "single"), (torch.bfloat16, torch.bfloat16, True, "tiled"),
     (torch.bfloat16, torch.float32, True, "single"), (torch.float32, None, True, "single"),
     (torch.bfloat16, None, False, "single")],
)  # fmt: skip
def test_rule_picks_path_from_gradient_buffers(w_dtype, mg_dtype, weight_grad, expected):
    """Default threshold and chunking, a budget of one full-width chunk of all loss rows: the
    single pass runs unless d_weight needs an fp32 buffer (a bf16 main_grad) larger than a tile;
    a bf16 gradient's int8 residual fits; a frozen weight needs neither."""
    wide = 3 * H  # 4 * V * wide > 4 * V * N_ROWS: the buffer exceeds the tile
    hidden, weight, _ = make_inputs(T, wide, V, dtype=w_dtype)
    targets, batch = loss_batch(hidden, weight, 1.0)
    w = _leaf(weight, mg_dtype).requires_grad_(weight_grad)
    loss, _, _ = fused_grpo_loss(hidden.requires_grad_(), w, targets, GRPOLossConfig(),
                                 vocab_size=VOCAB, impl="torch",
                                 memory_budget=TILE_FRACTION * 4 * V * N_ROWS, **batch)  # fmt: skip
    loss.backward()
    assert ran_path(loss) == expected


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("main_grad", [False, True])
def test_fused_2d_tiles(path, main_grad):
    """A small memory budget: vocab tiles that do not divide the vocabulary on the tiled path,
    5-row full-width chunks on the single pass (within a budget that also admits the extra fp32
    d_weight buffer of a bf16 grad); bf16, d_weight into a bf16 grad or main_grad."""
    tile = 4 * 5 * 11 if path == "tiled" else 4 * V * H
    cfg = GRPOLossConfig(**CONFIGS["token_full"])
    hidden, weight, _ = make_inputs(T, H, V, dtype=torch.bfloat16)
    targets, batch = loss_batch(hidden, weight, 0.8)
    op = dict(temperature=0.8, vocab_size=VOCAB, chunk_size=5, impl="torch",
              memory_budget=TILE_FRACTION * tile)  # fmt: skip
    fused, ref = run_both(cfg, hidden, weight, targets, batch, scale=2.0, path=path,
                          main_grad=torch.float32 if main_grad else None, **op)  # fmt: skip
    assert fused[6] == path
    if path == "tiled":  # the same passes: equal up to fp32 reassociation
        for i in (0, 2, 4, 5):
            a, b = fused[i].float(), ref[i].float()
            close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())
    else:
        assert_bf16_grads(fused, ref)
    assert fused[5].dtype == ref[5].dtype == (torch.float32 if main_grad else torch.bfloat16)


def test_fused_rejects_bad_inputs():
    hidden, weight, _ = make_inputs(T, H, V)
    targets, batch = loss_batch(hidden, weight, 1.0)
    with pytest.raises(TypeError, match="cfg"):
        fused_grpo_loss(hidden, weight, targets, {"kl_coef": 0.1}, **batch)
    bad = targets.clone()
    bad[CU[1] + PROMPT[1]] = VOCAB  # first response token of sequence 1
    with pytest.raises(ValueError, match=rf"targets\[{int(CU[1]) + PROMPT[1]}\]"):
        fused_grpo_loss(hidden, weight, bad, GRPOLossConfig(), vocab_size=VOCAB, **batch)
    gspo = GRPOLossConfig(ratio_level="sequence")
    with pytest.raises(ValueError, match="'sequence' \\(GSPO\\) needs all of a sequence"):
        fused_grpo_loss(hidden, weight, targets, gspo, path="fused_single_pass", **batch)


@pytest.mark.parametrize("path", [*PATHS, "op"])
def test_nonfinite_logprobs_raise_once_checked(path):
    """nonfinite="raise": a non-finite hidden row at a loss row raises naming the log-probs and
    the row, on every path, with the check deferred to one host sync (the single pass runs
    several chunks first; the bad row is in the last one); "count" gives a finite loss."""
    hidden, weight, _ = make_inputs(T, H, V)
    targets, batch = loss_batch(hidden, weight, 1.0)
    hidden[T - 2] = float("nan")  # a loss row of the last sequence
    row = int(batch["loss_mask"][: T - 2].sum())  # its index among the loss rows
    op = dict(vocab_size=VOCAB, chunk_size=4, impl="torch", path=FUSED.get(path, path))
    h = hidden.clone().requires_grad_()
    with pytest.raises(ValueError, match=rf"logprobs has 1 non-finite.*first at index {row}"):
        fused_grpo_loss(h, weight, targets, GRPOLossConfig(), **batch, **op)
    loss, met, _ = fused_grpo_loss(h, weight, targets, GRPOLossConfig(nonfinite="count"),
                                   **batch, **op)  # fmt: skip
    assert torch.isfinite(loss) and float(met["loss/nonfinite_count"].sum) == 1


# ---------------------------------------------------------------- GPU


def _gpu_problem(t: int, h: int, v: int, seq: int, prompt: int):
    dev = torch.device("cuda")
    hidden, weight, targets = make_inputs(t, h, v, dtype=torch.bfloat16, scale=3.0)
    hidden, weight, targets = hidden.to(dev), weight.to(dev), targets.to(dev)
    cu = torch.arange(0, t + 1, seq, device=dev)
    mask = (torch.arange(t, device=dev) % seq) >= prompt
    g = torch.Generator(device=dev).manual_seed(3)
    with torch.no_grad():
        logp = vocab_parallel_logprobs(hidden, weight, targets, rows=mask)
    adv = torch.randn(t // seq, generator=g, device=dev).repeat_interleave(seq)
    noise = 0.05 * torch.randn(3, t, generator=g, device=dev)
    batch = dict(old_logprobs=logp + noise[0], ref_logprobs=logp + noise[1],
                 rollout_logprobs=logp + noise[0] + 0.1 * noise[2], advantages=adv,
                 loss_mask=mask, cu_seqlens=cu)  # fmt: skip
    return hidden, weight, targets, batch


def _gpu_run(path, cfg, hidden, weight, targets, batch, gemm="auto"):
    """(loss, d_hidden, main_grad, extra peak bytes) of fused_grpo_loss on ``path``."""
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    w.main_grad = torch.zeros(w.shape, device=w.device)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss, _, _ = fused_grpo_loss(h, w, targets, cfg, path=FUSED[path], gemm=gemm, **batch)
    loss.backward()
    torch.cuda.synchronize()
    assert ran_path(loss) == path
    return loss.detach(), h.grad, w.main_grad, torch.cuda.max_memory_allocated() - base


def fp64_grads(cfg, hidden, weight, targets, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 (d_hidden, d_weight) of grpo_loss over the full logits (ground truth)."""
    z = (hidden.double() @ weight.double().t()).requires_grad_()
    lp64 = z.log_softmax(-1).gather(1, targets[:, None]).squeeze(1)
    ent64 = -(z.softmax(-1) * z.log_softmax(-1)).sum(-1)
    rows = batch["loss_mask"]
    loss64, _ = grpo_loss(cfg, logprobs=torch.where(rows, lp64, 0.0),
                          entropy=torch.where(rows, ent64, 0.0), **batch)  # fmt: skip
    loss64.backward()
    return z.grad @ weight.double(), z.grad.t() @ hidden.double()


@pytest.mark.gpu
def test_gpu_single_pass_host_syncs_do_not_grow_with_chunks():
    """The single pass queues every chunk without waiting for the GPU: its host syncs (input
    checks, the one deferred finiteness check) are the same for 7 chunks as for 2."""
    x = torch.ones(4, device="cuda")
    # calibration: each sync counts once (the first switch into debug mode reports one more)
    cuda_host_syncs(lambda: None)
    base = len(cuda_host_syncs(lambda: None))
    assert len(cuda_host_syncs(lambda: [x.tolist() for _ in range(3)])) == base + 3
    hidden, weight, targets, batch = _gpu_problem(1024, 256, 4096, 128, 16)

    def run(chunk: int) -> None:
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        w.main_grad = torch.zeros(w.shape, device=w.device)
        loss, _, _ = fused_grpo_loss(h, w, targets, GRPOLossConfig(), chunk_size=chunk,
                                     path="fused_single_pass", **batch)  # fmt: skip
        assert ran_path(loss) == "single"

    for chunk in (512, 128):  # compile and allocate first
        run(chunk)
    few, many = cuda_host_syncs(lambda: run(512)), cuda_host_syncs(lambda: run(128))
    assert sorted(few) == sorted(many), f"2 chunks: {few}\n7 chunks: {many}"


@pytest.mark.gpu
@pytest.mark.parametrize("gemm", ["separate", "fused_epilogue"])
def test_gpu_single_pass_accuracy_and_memory(gemm):
    """The TP = 8 shard of a 151936 vocabulary (V_local = 18992), bf16, an fp32 main_grad.
    "separate": with the threshold at 1024 rows the rule picks 3520-row chunks of fp32 logits
    (as path="fused_single_pass" does); "fused_epilogue": the default picks chunks of bf16
    shifted logits sized by the 1 GiB budget. Their gradient error against an fp64 reference is
    within the tiled path's, and the memory beyond the gradients is one full-width chunk plus
    the d_hidden buffers."""
    t, h, v, seq, prompt = 4096, 1024, 18992, 512, 64
    cfg = GRPOLossConfig(**CONFIGS["token_full"])
    hidden, weight, targets, batch = _gpu_problem(t, h, v, seq, prompt)
    n_rows = int(batch["loss_mask"].sum())
    w_mg = weight.clone().requires_grad_()
    w_mg.main_grad = torch.zeros(1, device=weight.device).expand(v, h)  # dtype only
    shape = HeadShape.of(w_mg, rows=n_rows)
    chunk, elem = (3520, 4) if gemm == "separate" else (n_rows, 2)  # epilogue: all rows fit
    for kw in (dict(single_pass_min_rows=1024), dict(path="fused_single_pass")):
        assert plan_lm_head(shape, loss=cfg, gemm=gemm, **kw).chunk_rows == chunk
    single = _gpu_run("single", cfg, hidden, weight, targets, batch, gemm)
    tiled = _gpu_run("tiled", cfg, hidden, weight, targets, batch, gemm)
    bound = t * h * 2 + chunk * v * elem + t * h * 4 + chunk * h * 6 + 64 * t * 4 + 2**24
    assert single[3] <= bound, (single[3] / 2**20, bound / 2**20)
    close(single[0], tiled[0], rtol=1e-5, atol=1e-6)

    dh64, dw64 = fp64_grads(cfg, hidden, weight, targets, batch)

    def rel(x, ref):
        return ((x.double() - ref).norm() / ref.norm()).item()

    errs = [(rel(r[1], dh64), rel(r[2], dw64)) for r in (single, tiled)]
    print(f"single pass (dh, dw) rel err {errs[0]}, tiled {errs[1]}")
    for e_single, e_tiled in zip(*errs, strict=True):
        assert e_single <= 1.1 * e_tiled + 1e-4, errs


# ---------------------------------------------------------------- TP = 2 (spawned)


def _tp2_case(rank, world, group, name, path, vocab, main_grad):
    hidden, weight, _ = make_inputs(T, H, V)
    weight[vocab:] = 50.0
    targets, batch = loss_batch(hidden, weight, 0.9, vocab)
    v_local, t_local = V // world, T // world
    w_loc = weight[rank * v_local : (rank + 1) * v_local]
    cfg = GRPOLossConfig(**CONFIGS[name])
    single = run_both(cfg, hidden, weight, targets, batch, scale=2.0, temperature=0.9,
                      vocab_size=vocab, impl="torch", main_grad=main_grad)[1]  # fmt: skip
    for sp in (False, True):
        h_loc = hidden[rank * t_local : (rank + 1) * t_local] if sp else hidden
        op = dict(tp_group=group, sequence_parallel=sp, temperature=0.9, vocab_size=vocab,
                  chunk_size=6, impl="torch", main_grad=main_grad)  # fmt: skip
        fused, ref = run_both(cfg, h_loc, w_loc, targets, batch, scale=2.0, path=path, **op)
        assert fused[6] == (path or "tiled")
        assert_same(fused, ref)
        # ... and both equal the TP=1 result (on this rank's slices).
        assert_same(fused, single, grads=False)
        dh_single = single[4][rank * t_local : (rank + 1) * t_local] if sp else single[4]
        close(fused[4], dh_single, rtol=1e-4, atol=1e-6)
        close(fused[5], single[5][rank * v_local : (rank + 1) * v_local], rtol=1e-4, atol=1e-6)


def _tp2_bf16_split_case(rank, world, group, vocab):
    """bf16 weight without main_grad: the single pass sums d_weight as bf16 + int8 residual on
    each rank (vocab 18: rank 1's shard is all padding); equal to the op path's within bf16."""
    hidden, weight, _ = make_inputs(T, H, V, dtype=torch.bfloat16)
    weight[vocab:] = 50.0
    targets, batch = loss_batch(hidden, weight, 0.9, vocab)
    v_local = V // world
    w_loc = weight[rank * v_local : (rank + 1) * v_local]
    cfg = GRPOLossConfig(**CONFIGS["token_full"])
    op = dict(tp_group=group, temperature=0.9, vocab_size=vocab, chunk_size=6, impl="torch")
    plan = fused_grpo_loss_plan(hidden, w_loc.requires_grad_(), targets, cfg, **batch, **op,
                                path="fused_single_pass")  # fmt: skip
    assert plan.accumulator == "split"
    fused, ref = run_both(cfg, hidden, w_loc, targets, batch, scale=2.0, path="single", **op)
    assert fused[6] == "single" and fused[5].dtype == torch.bfloat16
    assert_bf16_grads(fused, ref)
    if rank * v_local >= vocab:
        assert not fused[5].any()


def _tp2_body(rank: int, world_size: int) -> None:
    group = dist.new_group(list(range(world_size)))
    for vocab in (VOCAB, 18):
        _tp2_bf16_split_case(rank, world_size, group, vocab)
    for path in PATHS:
        _tp2_case(rank, world_size, group, "token_full", path, VOCAB, None)
    _tp2_case(rank, world_size, group, "token_plain", "single", VOCAB, torch.float32)
    # vocab 18 <= V_local: rank 1's shard is all padding (no logits, zero local gradients)
    _tp2_case(rank, world_size, group, "token_full", "single", 18, torch.float32)
    _tp2_case(rank, world_size, group, "gspo", None, VOCAB, None)
    _tp2_case(rank, world_size, group, "gspo", "tiled", VOCAB, torch.float32)


@pytest.mark.slow
def test_fused_matches_grpo_loss_tp2():
    run_distributed(_tp2_body, 2)
