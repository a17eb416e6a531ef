"""The fused op's preamble (loss context + target check) reads the device once: every value check
is a device-side count fetched with the row count in one copy; a failure still raises the error
of the host-side check. On the CPU the host reads are counted, on a GPU the synchronizing calls."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import torch

from megatron_grpo.loss import GRPOLossConfig
from megatron_grpo.loss.math import true_positions
from megatron_grpo.loss.segments import check_cu_seqlens, cu_seqlens_violations
from megatron_grpo.ops import fused_grpo_loss
from megatron_grpo.ops.lm_head import fused_grpo as fg
from tests.host_syncs import cuda_host_syncs
from tests.test_fused_grpo import (
    CONFIGS,
    VOCAB,
    H,
    T,
    V,
    _gpu_problem,
    loss_batch,
)
from tests.test_logprobs import make_inputs

# what reads a tensor's values on the host (on a GPU, each waits for it to drain)
HOST_READS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "nonzero", "cpu")


def setup_args(cfg: GRPOLossConfig, batch: dict, **op) -> fg._Args:
    """The arguments of ``fused_grpo_loss(..., cfg, **batch, **op)``, for ``_fused_setup``."""
    return fg._Args.of(cfg, None, None, None, False, batch | op, None)


def count_host_reads(monkeypatch, fn) -> list[str]:
    """The host reads of tensor values that ``fn()`` makes from Python."""
    reads: list[str] = []

    def counting(name, orig):
        def wrapper(*args, **kwargs):
            reads.append(name)
            return orig(*args, **kwargs)

        return wrapper

    with monkeypatch.context() as m:
        for name in HOST_READS:
            m.setattr(torch.Tensor, name, counting(name, getattr(torch.Tensor, name)))
        m.setattr(torch, "nonzero", counting("torch.nonzero", torch.nonzero))
        fn()
    return reads


def cpu_problem(**batch_changes):
    hidden, weight, _ = make_inputs(T, H, V)
    targets, batch = loss_batch(hidden, weight, 1.0)
    return hidden, weight, targets, batch | batch_changes


@pytest.mark.parametrize("nonfinite", ["raise", "count"])
@pytest.mark.parametrize(
    "denominator", [None, 2.0, torch.tensor(2.0)], ids=["none", "float", "tensor"]
)
def test_fused_setup_reads_the_device_once(monkeypatch, nonfinite, denominator):
    """Success path: one host fetch (cu_seqlens, non-finite inputs, denominator, targets and the
    number of loss rows together), and the rows are those of ``loss_mask.nonzero()``."""
    hidden, weight, targets, batch = cpu_problem(denominator=denominator)
    cfg = GRPOLossConfig(**CONFIGS["token_full"], nonfinite=nonfinite)
    args = setup_args(cfg, batch, vocab_size=VOCAB, impl="torch")
    out = []
    reads = count_host_reads(
        monkeypatch, lambda: out.append(fg._fused_setup(hidden, weight, targets, args))
    )
    assert reads == ["tolist"]
    lctx = out[0][1]
    assert torch.equal(lctx.index, batch["loss_mask"].nonzero().squeeze(1))


def _bad(name: str, pos: int, value: float) -> Callable[[dict], dict]:
    """The change of a batch that sets ``name[pos] = value``."""

    def change(batch):
        x = batch[name].clone()
        x[pos] = value
        return {name: x}

    return change


@pytest.mark.parametrize(
    "change,message",
    [
        ({"cu_seqlens": torch.tensor([1, 10, 18, 30])},
         "cu_seqlens must start at 0, got 1"),
        ({"cu_seqlens": torch.tensor([0, 18, 10, 30])},
         "cu_seqlens must be non-decreasing, got [0, 18, 10, 30]"),
        ({"cu_seqlens": torch.tensor([0, 10, 18, 29])},
         f"cu_seqlens must end at T={T}, got 29"),
        ({"denominator": torch.tensor(0.0)},
         "denominator must be a finite count > 0, got 0.0"),
        ({"denominator": torch.tensor(float("nan"))},
         "denominator must be a finite count > 0, got nan"),
        (_bad("old_logprobs", 15, float("nan")),
         "old_logprobs has 1 non-finite value(s) at unmasked positions (first at index 15: nan)"),
        (_bad("advantages", 29, float("inf")),
         "advantages has 1 non-finite value(s) at unmasked positions (first at index 29: inf)"),
        ("targets", f"targets[25] = {VOCAB} is outside [0, vocab_size={VOCAB}) at an active row "
                    "(mask such rows out with `rows`)"),
    ],
)  # fmt: skip
def test_fused_setup_errors_keep_their_messages(change, message):
    """Each deferred check, failing, raises the exact error of its host-side check."""
    hidden, weight, targets, batch = cpu_problem()
    assert bool(batch["loss_mask"][[15, 25, 29]].all())  # loss rows
    if change == "targets":
        targets = targets.clone()
        targets[25] = VOCAB
    else:
        batch = batch | (change(batch) if callable(change) else change)
    cfg = GRPOLossConfig(**CONFIGS["token_full"])
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        fused_grpo_loss(hidden, weight, targets, cfg, vocab_size=VOCAB, impl="torch", **batch)


@pytest.mark.parametrize("nonfinite", ["raise", "count"])
def test_nonfinite_row_with_a_bad_target(nonfinite):
    """A loss row with a NaN input and an out-of-vocabulary target: "raise" names the input (its
    check comes first, as before); "count" drops the row, so its target is never checked."""
    hidden, weight, targets, batch = cpu_problem()
    batch = batch | _bad("old_logprobs", 25, float("nan"))(batch)
    targets = targets.clone()
    targets[25] = -3
    cfg = GRPOLossConfig(**CONFIGS["token_full"], nonfinite=nonfinite)
    op = dict(vocab_size=VOCAB, impl="torch")
    if nonfinite == "raise":
        with pytest.raises(ValueError, match=r"^old_logprobs has 1 non-finite"):
            fused_grpo_loss(hidden, weight, targets, cfg, **batch, **op)
        return
    loss, metrics, _ = fused_grpo_loss(hidden, weight, targets, cfg, **batch, **op)
    assert torch.isfinite(loss) and float(metrics["loss/nonfinite_count"].sum) == 1


@pytest.mark.parametrize("p", [0.0, 0.3, 0.9, 1.0])
def test_true_positions_is_nonzero(p):
    g = torch.Generator().manual_seed(int(p * 10))
    mask = torch.rand(257, generator=g) < p
    want = mask.nonzero().squeeze(1)
    got = true_positions(mask, want.numel())
    assert got.dtype == torch.int64 and torch.equal(got, want)


@pytest.mark.parametrize(
    "cu",
    [[0, 10, 18, 30], [0, 30], [0, 0, 30, 30], [30], [0], [1, 10, 30], [0, 18, 10, 30],
     [0, 10, 29], [0, 10, 31], [5, 3, 30]],
)  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_cu_seqlens_violations_agree_with_the_host_check(cu, dtype):
    cu = torch.tensor(cu, dtype=dtype)
    try:
        check_cu_seqlens(cu, T)
        valid = True
    except ValueError:
        valid = False
    bad = cu_seqlens_violations(cu, T)
    assert bad.dtype == torch.int64 and (int(bad) == 0) == valid


# ---------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("cu_device", ["cuda", "cpu"])
@pytest.mark.parametrize("denominator", [None, 1.0, "cuda"])
@pytest.mark.parametrize("nonfinite", ["raise", "count"])
def test_gpu_fused_setup_one_host_sync(cu_device, denominator, nonfinite):
    """``_fused_setup`` (loss context, target check, plan) waits for the GPU once, whether
    cu_seqlens is on the GPU or the host and the denominator a number or a GPU tensor."""
    x = torch.ones(4, device="cuda")
    # calibration: each sync counts once (the first switch into debug mode reports one more)
    cuda_host_syncs(lambda: None)
    base = len(cuda_host_syncs(lambda: None))
    assert len(cuda_host_syncs(lambda: [x.tolist() for _ in range(3)])) == base + 3
    hidden, weight, targets, batch = _gpu_problem(1024, 256, 4096, 128, 16)
    batch["cu_seqlens"] = batch["cu_seqlens"].to(cu_device)
    if denominator is not None:
        d = torch.tensor(900.0, device="cuda") if denominator == "cuda" else denominator
        batch["denominator"] = d
    cfg = GRPOLossConfig(**CONFIGS["token_full"], nonfinite=nonfinite)
    args = setup_args(cfg, batch)

    def setup():
        return fg._fused_setup(hidden, weight, targets, args)

    lctx = setup()[1]  # compile and allocate first
    torch.cuda.synchronize()
    assert torch.equal(lctx.index, batch["loss_mask"].nonzero().squeeze(1))
    syncs = cuda_host_syncs(setup)
    assert len(syncs) <= base + 1, syncs


@pytest.mark.gpu
@pytest.mark.parametrize("what", ["cu_seqlens", "nonfinite", "targets", "denominator"])
def test_gpu_fused_setup_errors_keep_their_messages(what):
    hidden, weight, targets, batch = _gpu_problem(1024, 256, 4096, 128, 16)
    if what == "cu_seqlens":
        batch["cu_seqlens"] = batch["cu_seqlens"].clone()
        batch["cu_seqlens"][2] = 1
        message = "cu_seqlens must be non-decreasing, got [0, 128, 1, "
    elif what == "nonfinite":
        batch["advantages"] = batch["advantages"].clone()
        batch["advantages"][300] = float("inf")
        message = "advantages has 1 non-finite value(s) at unmasked positions (first at index 300"
    elif what == "targets":
        targets = targets.clone()
        targets[300] = 4096
        message = "targets[300] = 4096 is outside [0, vocab_size=4096) at an active row"
    else:
        batch["denominator"] = torch.tensor(-1.0, device="cuda")
        message = "denominator must be a finite count > 0, got -1.0"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
        fused_grpo_loss(hidden, weight, targets, GRPOLossConfig(), **batch)


@pytest.mark.parametrize("rows", ["none", "all", "some", "empty"])
def test_op_select_rows_reads_the_device_once(monkeypatch, rows):
    """The op's row selection (vocab_parallel_logprobs ``rows=``): the row count and the target
    check in one fetch; the indices are those of ``rows.nonzero()`` (None: every row); a bad
    target at an active row still raises its error, one at an inactive row does not."""
    from megatron_grpo.ops.lm_head.head import select_rows

    t = torch.tensor([3, 0, -100, 7, 2, -100, 5])
    mask = {"none": None, "all": torch.ones(7, dtype=torch.bool), "some": t >= 0,
            "empty": torch.zeros(7, dtype=torch.bool)}[rows]  # fmt: skip
    out = []
    reads = count_host_reads(monkeypatch, lambda: out.append(select_rows(mask, t.clamp(min=0), 8)))
    assert reads == ["tolist"]
    want = None if mask is None or bool(mask.all()) else mask.nonzero().squeeze(1)
    assert (out[0] is None) == (want is None)
    if want is not None:
        assert torch.equal(out[0], want)
    assert select_rows(t >= 0, t, 8) is not None  # -100 only at inactive rows
    with pytest.raises(ValueError, match=r"targets\[2\] = -100 is outside \[0, vocab_size=8\)"):
        select_rows(None, t, 8)


@pytest.mark.gpu
def test_gpu_denominator_and_host_copies_do_not_sync():
    """GRPOStep's loss function moves the batch with ``host_to_device`` (a pageable source: an
    async staged copy) and counts the denominator from the host ``cu_seqlens``: no host sync."""
    from megatron_grpo.loss import local_denominator
    from megatron_grpo.loss.segments import host_to_device

    dev = torch.device("cuda")
    cu = torch.tensor([0, 3, 7, 12])
    mask = host_to_device(torch.arange(12) % 3 > 0, dev)
    cfg = GRPOLossConfig(loss_agg="seq_mean_token_mean")
    cuda_host_syncs(lambda: None)  # the first switch into debug mode reports one more
    found = cuda_host_syncs(lambda: (host_to_device(torch.arange(12), dev),
                                 local_denominator(cfg, mask, cu)))  # fmt: skip
    assert found == [], found
    assert local_denominator(cfg, mask, cu).item() == 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_host_to_device_returns_while_the_stream_is_busy():
    """One GPU: a pageable source larger than the driver's staging buffer goes through pinned
    memory, so the call returns while earlier kernels still run (the driver's own pageable copy
    waits for them) and the copy lands once they finish."""
    from megatron_grpo.loss.segments import host_to_device

    dev = torch.device("cuda")
    x = torch.arange(16 << 20, dtype=torch.float32)  # 64 MiB, pageable
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second of one busy kernel
    y = host_to_device(x, dev)
    busy = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert busy, "host_to_device waited for the stream"
    assert torch.equal(y.cpu(), x)
