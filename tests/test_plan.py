"""The LM-head plan (ops/lm_head/plan.py): deterministic and explained by its fields, the memory-budget
knob, its errors, and every path it can choose (op, fused_tiled, fused_single_pass, megatron; both
backward loop orders) against a float64 reference and Megatron's vocab_parallel_cross_entropy at
TP = 4, 2, 1 with and without sequence parallelism (one spawn of 4 gloo ranks), at an odd
vocabulary (padded rows on the last shard) and an odd number of loss rows."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from megatron_grpo.loss import GRPOLossConfig, grpo_loss
from megatron_grpo.megatron.plan.memory import GIB, loss_working_set
from megatron_grpo.ops import (
    DEFAULT_MEMORY_BUDGET,
    HeadShape,
    fused_grpo_loss,
    fused_grpo_loss_plan,
    logprobs_plan,
    plan_lm_head,
    vocab_parallel_logprobs,
)
from megatron_grpo.ops.lm_head.plan import (
    ACCUMULATOR_TILES,
    ACCUMULATORS,
    LOOP_ORDERS,
    PATHS,
    REQUESTS,
    SPLIT_MIN_ROWS,
    TILE_FRACTION,
    WEIGHT_GRADS,
)
from tests.dist_utils import run_distributed
from tests.test_fused_grpo import metric_values, ran_path
from tests.test_logprobs import close, make_inputs

# ---------------------------------------------------------------- the plan itself

SHAPES = [  # rows, V_local, n_valid, H, dtype, main_grad dtype
    (8192, 151936, 151936, 4096, torch.bfloat16, torch.float32),
    (8192, 151936, 151936, 4096, torch.bfloat16, None),
    (3000, 18992, 18990, 4096, torch.bfloat16, torch.float32),
    (300, 16384, 16384, 2048, torch.float32, None),
    (19, 10, 7, 16, torch.float64, None),
    (0, 64, 64, 16, torch.bfloat16, torch.bfloat16),
]
OPTIONS = [dict(), dict(chunk_size=64), dict(memory_budget=4 * GIB), dict(memory_budget=2**16)]


def _plans():
    """(shape, request, options, plan or the ValueError) over a grid that reaches every path,
    both loop orders and every d_weight mode."""
    cfg = GRPOLossConfig()
    for args, request, opts, want in itertools.product(
        SHAPES, (None, "fused_tiled", "fused_single_pass", "op"), OPTIONS, (True, False)
    ):
        shape = HeadShape(*args, "cuda", want_dh=want, want_dw=want)
        try:
            plan = plan_lm_head(shape, path=request, loss=cfg, impl="torch", **opts)
        except ValueError as e:
            plan = e
        yield shape, request, opts, plan


def test_plan_is_deterministic_and_explained_by_its_fields():
    seen = {"path": set(), "loop_order": set(), "weight_grad": set(), "accumulator": set()}
    for shape, request, opts, plan in _plans():
        if isinstance(plan, ValueError):  # only an explicit single pass that cannot fit
            assert request == "fused_single_pass" and "memory_budget" in str(plan)
            continue
        again = plan_lm_head(shape, path=request, loss=GRPOLossConfig(), impl="torch", **opts)
        assert again == plan and hash(again) == hash(plan)  # frozen, equal inputs: equal plan
        for field in seen:
            seen[field].add(getattr(plan, field))
        _check_fields(shape, request, plan)
    assert seen["path"] == set(PATHS) - {"megatron"}  # "megatron" only when asked for
    assert seen["loop_order"] == set(LOOP_ORDERS)
    assert seen["weight_grad"] == set(WEIGHT_GRADS)
    assert seen["accumulator"] == {None, *ACCUMULATORS}


def test_sequence_ratio_never_runs_the_single_pass():
    """GSPO over the grid where a token ratio reaches every path: automatic and "fused_tiled"
    requests run the tiled path (same tiles), "op" the op; an explicit single pass raises."""
    gspo = GRPOLossConfig(ratio_level="sequence")
    token_single = 0
    for shape, request, opts, token in _plans():
        token_single += getattr(token, "path", None) == "fused_single_pass"
        try:
            plan = plan_lm_head(shape, path=request, loss=gspo, impl="torch", **opts)
        except ValueError as e:
            assert request == "fused_single_pass" and "'sequence' (GSPO)" in str(e)
            continue
        assert request != "fused_single_pass"
        assert plan.path == ("op" if request == "op" else "fused_tiled") and plan.chunk_rows is None
        if not isinstance(token, ValueError):
            assert (plan.tile_rows, plan.tile_cols) == (token.tile_rows, token.tile_cols)
    assert token_single > 0


def _check_fields(shape: HeadShape, request: str | None, plan) -> None:
    """Each field follows from the inputs as the module docstring says; str(plan) names them."""
    text = str(plan)
    assert "\n" not in text and text.startswith(f"{plan.path} ({plan.reason})")
    assert f"d_weight {plan.weight_grad}" in text and f"{plan.impl} kernels" in text
    assert f"{plan.tile_rows} x {plan.tile_cols}" in text
    assert plan.loop_order.replace("_", " ") in text and "memory budget" in text
    in_place = plan.weight_grad in ("none", "accumulate_fp32")
    assert (plan.loop_order == "rows_outer") == in_place
    assert (plan.weight_grad == "none") == (not shape.want_dw)
    assert plan.tile_rows * plan.tile_cols * 4 <= max(plan.tile_bytes, 4 * plan.tile_rows)
    assert plan.rows == shape.rows and plan.n_valid == shape.n_valid
    if plan.path != "fused_single_pass":
        assert plan.chunk_rows is None and plan.accumulator is None
        assert plan.accumulator_bytes == 0
        if request is None and shape.rows and (shape.want_dh or shape.want_dw):
            assert plan.reason.startswith("auto: ")
        return
    assert f"{plan.chunk_rows}-row full-width chunks" in text
    assert 1 <= plan.chunk_rows <= shape.rows
    assert plan.chunk_rows * shape.v_local * 4 <= plan.tile_bytes
    kind = {"none": None, "accumulate_fp32": "in_place"}.get(plan.weight_grad)
    if plan.weight_grad in ("write_tiles", "add_tiles"):  # beyond the gradient: int8 or fp32
        split = plan.weight_grad == "write_tiles" and shape.dtype == torch.bfloat16
        kind = "split" if split else "fp32"
    per_elem = {None: 0, "in_place": 0, "split": 1, "fp32": 4}[kind]
    assert plan.accumulator == kind
    assert plan.accumulator_bytes == per_elem * shape.v_local * shape.hidden
    assert plan.accumulator_bytes <= ACCUMULATOR_TILES * plan.tile_bytes
    if request is None:  # the automatic rule's threshold
        assert plan.chunk_rows >= min(4096, shape.rows)


def test_default_budget_and_the_knob():
    """The default budget's tile is the measured 256 MiB; its working set at V_local = 151936,
    H = 4096 (bf16, TP = 1) is at most 1 GiB; a larger budget buys larger tiles (less
    accumulator traffic) and admits the single pass on a shard where the default does not."""
    assert DEFAULT_MEMORY_BUDGET == 2**30 and DEFAULT_MEMORY_BUDGET // TILE_FRACTION == 2**28
    for tokens, main_grad, path in itertools.product((8192, 32768), (4, None), ("fused", "op")):
        ws = loss_working_set(path, tokens=tokens, hidden=4096, v_local=151936, param_bytes=2,
                              sp=False, tp=1, main_grad_bytes=main_grad)  # fmt: skip
        assert ws.total <= 1.0 * GIB, (tokens, main_grad, path, ws.total / GIB)
    shape = HeadShape(32768, 151936, 151936, 4096, torch.bfloat16, torch.float32, "cuda")
    small, big = (plan_lm_head(shape, path="op", memory_budget=b) for b in (2**28, 2**32))
    assert small.tile_rows * small.tile_cols < big.tile_rows * big.tile_cols
    assert len(small.tiling().row_blocks()) > len(big.tiling().row_blocks())
    tp8 = HeadShape(8192, 18992, 18992, 4096, torch.bfloat16, torch.float32, "cuda")
    cfg = GRPOLossConfig()
    sep = dict(loss=cfg, gemm="separate")  # fp32 chunks: 3520 rows < 4096 at the default
    assert plan_lm_head(tp8, **sep).path == "fused_tiled"
    wide = plan_lm_head(tp8, memory_budget=2 * GIB, **sep)
    assert wide.path == "fused_single_pass" and wide.chunk_rows == 7040
    # The fused epilogue keeps bf16 shifted logits: 2 bytes + block stats + an fp32 d_hidden a
    # row, so the default budget holds 3200 full-width rows of a 152k shard (>= 1024: single
    # pass); without an fp32 buffer for d_weight its int8 residual (0.58 GiB) leaves 1344 rows,
    # below SPLIT_MIN_ROWS (tiled; explicit: the single pass), and 4 GiB leave 11136 rows;
    # a bf16 main_grad's fp32 buffer (2.3 GiB) needs a larger budget.
    full = HeadShape(8192, 151936, 151936, 4096, torch.bfloat16, torch.float32, "cuda")
    epi = dict(loss=cfg, impl="torch", gemm="fused_epilogue")
    plan = plan_lm_head(full, **epi)
    assert (plan.path, plan.chunk_rows) == ("fused_single_pass", 3200)
    bf16_grad = replace(full, main_grad_dtype=None)
    assert plan_lm_head(bf16_grad, **epi).path == "fused_tiled"
    no_main_grad = plan_lm_head(bf16_grad, path="fused_single_pass", **epi)
    assert (no_main_grad.path, no_main_grad.chunk_rows) == ("fused_single_pass", 1344)
    assert no_main_grad.accumulator == "split" and no_main_grad.accumulator_bytes == 151936 * 4096
    wide = plan_lm_head(replace(bf16_grad, rows=32768), memory_budget=4 * GIB, **epi)
    assert (wide.path, wide.chunk_rows, wide.accumulator) == ("fused_single_pass", 11136, "split")
    assert SPLIT_MIN_ROWS == 4096
    bf16_main_grad = replace(full, main_grad_dtype=torch.bfloat16)
    assert plan_lm_head(bf16_main_grad, **epi).path == "fused_tiled"
    assert plan_lm_head(bf16_main_grad, memory_budget=4 * GIB, **epi).chunk_rows == 5440


def test_requests_and_errors():
    shape = HeadShape(100, 151936, 151936, 4096, torch.bfloat16, None, "cpu")
    gspo = GRPOLossConfig(ratio_level="sequence")
    assert plan_lm_head(shape).path == "op"  # log-probs alone
    for request in (None, "fused"):
        plan = plan_lm_head(shape, path=request, loss=gspo)
        assert plan.path == "fused_tiled" and "sequence" in plan.reason
    assert plan_lm_head(shape, path="fused_tiled", loss=gspo).reason == "requested"
    assert plan_lm_head(shape, path="op", loss=gspo).path == "op"
    megatron = plan_lm_head(shape, path="megatron", loss=GRPOLossConfig())
    assert megatron.impl is None and str(megatron).startswith("megatron (requested)")
    assert set(REQUESTS) == {"fused", *PATHS}
    errors = [  # (request, loss config, options, message)
        ("fused_single_pass", GRPOLossConfig(), {}, "memory_budget"),  # extra fp32 d_weight
        ("fused_single_pass", gspo, {}, "sequence.*'fused' / 'fused_tiled' or 'op'"),
        ("fused_tiled", None, {}, "needs a loss config"),
        ("megatron", GRPOLossConfig(entropy_coef=0.1), {}, "entropy_coef"),
        ("liger", None, {}, "path must be one of"),
        (None, None, dict(memory_budget=0), "memory_budget"),
        (None, None, dict(memory_budget=True), "memory_budget"),
        (None, None, dict(chunk_size=0), "chunk_size"),
        (None, None, dict(impl="cuda"), "impl"),
    ]
    for request, loss, opts, match in errors:
        with pytest.raises(ValueError, match=match):
            plan_lm_head(shape, path=request, loss=loss, **opts)


def test_entry_points_run_their_plan():
    """fused_grpo_loss / vocab_parallel_logprobs run the plan their *_plan twins return; the
    single pass without gradients is the tiled stats pass; "megatron" is GRPOStep's alone."""
    h, w, batch, targets = _problem(1, 0, False, torch.float32, requires_grad=True)
    cfg = GRPOLossConfig(kl_coef=0.05)
    for path in (None, "fused_tiled", "fused_single_pass", "op"):
        plan = fused_grpo_loss_plan(h, w, targets, cfg, vocab_size=VOCAB, path=path, **batch)
        loss, _, _ = fused_grpo_loss(h, w, targets, cfg, vocab_size=VOCAB, path=path, **batch)
        assert ran_path(loss) == {"fused_tiled": "tiled", "fused_single_pass": "single"}.get(
            plan.path, "op"
        )
        assert plan.path == (path or "fused_single_pass")  # 19 loss rows: one chunk
    op_plan = logprobs_plan(h, w, targets, vocab_size=VOCAB, rows=batch["loss_mask"])
    assert op_plan.path == "op" and op_plan.rows == int(batch["loss_mask"].sum())
    with pytest.raises(ValueError, match="GRPOStep"):
        fused_grpo_loss(h, w, targets, cfg, vocab_size=VOCAB, path="megatron", **batch)
    with pytest.raises(ValueError, match="memory_budget"):
        vocab_parallel_logprobs(h, w, targets % VOCAB, memory_budget=-1)


# ---------------------------------------------------------------- every path vs references

T, H, V, VOCAB = 28, 16, 40, 37  # V: padded rows of the full weight; VOCAB odd
CU = torch.tensor([0, 9, 20, 28])
PROMPT = (3, 2, 4)  # 19 loss rows
TEMPERATURE = 0.9
CFG = GRPOLossConfig(kl_coef=0.05, clip_eps_high=0.28, is_correction_level="token",
                     is_truncate=2.0)  # fmt: skip
CFG_ENTROPY = GRPOLossConfig(kl_coef=0.05, entropy_coef=0.01, loss_agg="seq_mean_token_mean")
CHUNK = 5


def _problem(tp: int, rank: int, sp: bool, dtype: torch.dtype, requires_grad: bool = False):
    """This rank's (hidden, weight shard, loss inputs, targets); identical on every rank."""
    hidden, weight, _ = make_inputs(T, H, V, dtype=dtype, seed=5, scale=3.0)
    weight[VOCAB:] = 50.0  # padded rows: would dominate every softmax if they counted
    g = torch.Generator().manual_seed(9)
    mask = torch.ones(T, dtype=torch.bool)
    for start, n in zip(CU[:-1].tolist(), PROMPT, strict=True):
        mask[start : start + n] = False
    targets = torch.where(mask, torch.randint(0, VOCAB, (T,), generator=g), -100)
    with torch.no_grad():
        logp = vocab_parallel_logprobs(
            hidden.double(), weight[:VOCAB].double(), targets, temperature=TEMPERATURE,
            rows=mask, impl="torch",
        )  # fmt: skip
    noise = 0.3 * torch.randn(3, T, generator=g)
    batch = dict(old_logprobs=logp.float() + noise[0], ref_logprobs=logp.float() + noise[1],
                 rollout_logprobs=logp.float() + noise[0] + 0.1 * noise[2],
                 advantages=torch.randn(3, generator=g).repeat_interleave(CU.diff()),
                 loss_mask=mask, cu_seqlens=CU)  # fmt: skip
    v_local, t_local = V // tp, T // tp
    h = hidden[rank * t_local : (rank + 1) * t_local] if sp else hidden
    w = weight[rank * v_local : (rank + 1) * v_local]
    return h.clone().requires_grad_(requires_grad), w.clone().requires_grad_(requires_grad), \
        batch, targets  # fmt: skip


def _budget(path: str) -> int:
    """Single pass: full-width chunks and its extra fp32 d_weight fit; else tiles of CHUNK x 6
    (several vocab tiles per shard, not dividing it)."""
    return TILE_FRACTION * (4 * V * H if path == "fused_single_pass" else 4 * CHUNK * 6)


def _ours(path, cfg, group, sp, dtype, tp, rank, gemm="separate"):
    """(loss, metrics, logp, d_hidden, d_weight) of ``path`` through fused_grpo_loss (torch
    kernels; ``gemm``: the plan's GEMM mode, run by its torch reference)."""
    h, w, batch, targets = _problem(tp, rank, sp, dtype, requires_grad=True)
    kw = dict(tp_group=group, sequence_parallel=sp, temperature=TEMPERATURE, vocab_size=VOCAB,
              chunk_size=CHUNK, impl="torch", memory_budget=_budget(path), path=path,
              gemm=gemm)  # fmt: skip
    plan = fused_grpo_loss_plan(h, w, targets, cfg, **kw, **batch)
    assert (plan.path, plan.gemm) == (path, gemm), plan
    assert plan.loop_order == ("rows_outer" if dtype == torch.float32 else "vocab_outer")
    loss, metrics, logp = fused_grpo_loss(h, w, targets, cfg, **kw, **batch)
    (2.0 * loss).backward()
    return loss.detach(), metric_values(metrics), logp, h.grad, w.grad


def _megatron(cfg, group, sp, tp, rank):
    """Path "megatron": fp32 logits materialized, padded columns -inf (as GRPOStep does), logp =
    -vocab_parallel_cross_entropy, then grpo_loss; d_hidden all-reduced (then this rank's SP
    rows)."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    h_full, w, batch, targets = _problem(tp, rank, False, torch.float32, requires_grad=True)
    logits = (h_full @ w.t()) / TEMPERATURE
    n_valid = VOCAB - rank * (V // tp)
    logits = torch.cat([logits[:, :n_valid], torch.full_like(logits[:, n_valid:], -torch.inf)], 1)
    safe = torch.where(batch["loss_mask"], targets, 0)
    logp = -vocab_parallel_cross_entropy(logits.clone(), safe)  # it mutates fp32 input in place
    logp = torch.where(batch["loss_mask"], logp, 0.0)
    loss, metrics = grpo_loss(cfg, logprobs=logp, **batch)
    (2.0 * loss).backward()
    dh = h_full.grad.clone()
    if group is not None:
        dist.all_reduce(dh, group=group)
    t_local = T // tp
    dh = dh[rank * t_local : (rank + 1) * t_local] if sp else dh
    return loss.detach(), metric_values(metrics), logp.detach(), dh, w.grad


def _float64(cfg, sp, tp, rank):
    """Full float64 logits, grpo_loss; this rank's slices of the gradients."""
    hidden, weight, batch, targets = _problem(1, 0, False, torch.float64, requires_grad=True)
    z = (hidden @ weight[:VOCAB].t()) / TEMPERATURE
    logsm = z.log_softmax(-1)
    rows = batch["loss_mask"]
    lp = torch.where(rows, logsm.gather(1, torch.where(rows, targets, 0)[:, None])[:, 0], 0.0)
    ent = torch.where(rows, -(logsm.exp() * logsm).sum(-1), 0.0)
    loss, metrics = grpo_loss(cfg, logprobs=lp, entropy=ent, **batch)
    (2.0 * loss).backward()
    v_local, t_local = V // tp, T // tp
    dh = hidden.grad[rank * t_local : (rank + 1) * t_local] if sp else hidden.grad
    return loss.detach(), metric_values(metrics), lp.detach(), dh, \
        weight.grad[rank * v_local : (rank + 1) * v_local]  # fmt: skip


def _same(got, want, what: str, metrics: bool = True) -> None:
    try:
        close(got[0], want[0], rtol=1e-5, atol=1e-6)
        close(got[2], want[2], rtol=1e-5, atol=1e-5)
        close(got[3], want[3], rtol=1e-4, atol=1e-6)
        close(got[4], want[4], rtol=1e-4, atol=1e-6)
        if metrics:
            assert got[1].keys() == want[1].keys()
            for k, v in want[1].items():
                assert v == pytest.approx(got[1][k], rel=1e-4, abs=1e-5, nan_ok=True), k
    except AssertionError as e:
        raise AssertionError(f"{what}: {e}") from e


def _check_tp(group, tp: int, rank: int) -> None:
    for sp in (False, True):
        where = f"TP={tp} SP={sp}"
        ref = {"plain": _float64(CFG, sp, tp, rank), "entropy": _float64(CFG_ENTROPY, sp, tp, rank)}
        ce = _megatron(CFG, group, sp, tp, rank)
        _same(ce, ref["plain"], f"{where} megatron vs float64", metrics=False)
        runs = [(p, d, "separate") for p in PATHS[:3] for d in (torch.float32, torch.float64)]
        runs += [(p, torch.float32, "fused_epilogue") for p in PATHS[:3]]
        for path, dtype, gemm in runs:
            what = f"{where} {path} {dtype} {gemm}"
            ours = _ours(path, CFG, group, sp, dtype, tp, rank, gemm)
            _same(ours, ref["plain"], f"{what} vs float64", metrics=False)
            _same(ours, ce, f"{what} vs vocab_parallel_cross_entropy")
            ours = _ours(path, CFG_ENTROPY, group, sp, dtype, tp, rank, gemm)
            _same(ours, ref["entropy"], f"{what} entropy vs float64", False)


def _body(rank: int, world_size: int) -> None:
    from megatron.core import parallel_state as ps

    for tp in (4, 2, 1):
        ps.initialize_model_parallel(tensor_model_parallel_size=tp)
        group = ps.get_tensor_model_parallel_group()
        _check_tp(group if tp > 1 else None, tp, ps.get_tensor_model_parallel_rank())
        ps.destroy_model_parallel()


@pytest.mark.slow
def test_every_path_matches_float64_and_megatron_tp_1_2_4():
    run_distributed(_body, 4)
