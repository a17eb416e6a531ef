"""A checkpoint saved at EP 2 resumes at EP 2 bit-exactly: 1 step + save + resume to 2 steps
gives the uninterrupted run's metrics and weights (two gloo ranks, MoE tiny recipe, TP 1)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.dist_utils import run_distributed

MOE = [
    "parallel.tensor_model_parallel_size=1",
    "parallel.expert_model_parallel_size=2",
    "model.num_moe_experts=4",
    "model.moe_router_topk=2",
    "model.moe_ffn_hidden_size=64",
]


def _body(rank: int, world: int, tmp: Path) -> None:
    from megatron_grpo.megatron.model.build import unwrap
    from tests.test_train_checkpoint import _metrics, _run

    ck = tmp / "ckpt"
    full = _run(tmp, "full", 2, ["checkpoint.dir=null", *MOE])
    _run(tmp, "part", 1, [f"checkpoint.dir={ck}", "checkpoint.save_interval=1", *MOE])
    resumed = _run(tmp, "part", 2, [f"checkpoint.dir={ck}", *MOE], resume=True)
    assert resumed.start_step == 1
    want, got = unwrap(full.model[0]).state_dict(), unwrap(resumed.model[0]).state_dict()
    assert any(".experts." in k for k in want)  # this rank's half of the experts
    for k, v in want.items():
        if torch.is_tensor(v):
            torch.testing.assert_close(got[k], v, rtol=0, atol=0, msg=k)
    if rank == 0:
        a, b = _metrics(tmp / "full" / "metrics.jsonl"), _metrics(tmp / "part" / "metrics.jsonl")
        assert [m["step"] for m in b] == [1, 2]
        for x, y in zip(a, b, strict=True):
            timeless = [{k: v for k, v in m.items() if not k.startswith("perf/")} for m in (x, y)]
            assert timeless[0] == timeless[1], (x, y)


@pytest.mark.slow
def test_ep2_checkpoint_resumes_bit_exactly(tmp_path):
    run_distributed(_body, 2, tmp_path, timeout=600)
