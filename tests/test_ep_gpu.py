"""Expert parallelism on GPUs (2 GPUs each, NCCL; skipped with fewer): the engine captures the
gathered dispatch's decode step in CUDA graphs at EP 2 (any host sync would fail the capture);
megatron-core's all-to-all dispatcher syncs less with the sort-based permutation.

    python -m pytest -q -m gpu tests/test_ep_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from megatron_grpo.megatron import ParallelConfig, unwrap
from tests.dist_utils import run_distributed
from tests.ep_utils import check_graphs_match_eager, switch_dispatch
from tests.host_syncs import cuda_host_syncs
from tests.megatron_utils import build_layout, tiny_model

needs_2_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"
)


def _cfg(**kw):
    return tiny_model(
        num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=64, moe_grouped_gemm=True,
        moe_token_dispatcher_type="alltoall", params_dtype="bfloat16", **kw,
    )  # fmt: skip


def _sync_body(rank: int, world: int) -> None:
    from megatron.core.transformer.moe import token_dispatcher

    from megatron_grpo.megatron.moe.alltoall_permute import make_sort_permute

    chunks = build_layout(ParallelConfig(expert_model_parallel_size=2), _cfg(num_layers=1))
    mlp = unwrap(chunks[0]).decoder.layers[0].mlp
    x = torch.randn(37, 1, 64, device="cuda", dtype=torch.bfloat16)
    switch_dispatch(chunks, "alltoall")
    installed = token_dispatcher.permute
    megatron_permute = getattr(installed, "megatron_permute", installed)

    def syncs(permute) -> int:
        def fwd_bwd():
            out, _ = mlp(x.clone().requires_grad_())
            out.float().sum().backward()

        token_dispatcher.permute = permute
        fwd_bwd()  # warm-up: lazy initialization syncs once
        return min(len(cuda_host_syncs(fwd_bwd)) for _ in range(2))

    counts = {
        "installed": syncs(installed),
        "megatron": syncs(megatron_permute),
        "sort": syncs(make_sort_permute(megatron_permute)),
    }
    token_dispatcher.permute = installed
    # the permute installed (the sort permute, at every version) syncs no more than either
    assert counts["installed"] <= min(counts["megatron"], counts["sort"]), counts


@needs_2_gpus
@pytest.mark.gpu
def test_gpu_sort_permute_syncs_less_than_megatron_cores():
    """2 GPUs: megatron-core's all-to-all fwd+bwd runs with the sort permute, which syncs no
    more than megatron-core's own (0.16's masked one syncs more; 0.19's argsort one no less,
    measured with 3c3e4fc on 2 of 4 H200s, and its backward adds rows atomically). (That the
    gathered dispatch's decode forward never syncs is shown by the engine capturing it in
    CUDA graphs at EP 2: ``test_gpu_ep2_decode_runs_in_cuda_graphs``.)"""
    run_distributed(_sync_body, 2, backend="nccl")


def _graphs_body(rank: int, world: int) -> None:
    chunks = build_layout(ParallelConfig(expert_model_parallel_size=2), _cfg())
    model = unwrap(chunks[0])
    g = torch.Generator().manual_seed(4 + rank)
    prompts = [torch.randint(0, 100, (int(n),), generator=g).tolist() for n in range(3, 20 + rank)]
    check_graphs_match_eager(model, prompts)  # "CUDA graphs on"


@needs_2_gpus
@pytest.mark.gpu
def test_gpu_ep2_decode_runs_in_cuda_graphs():
    """2 GPUs: the engine captures EP 2 decode steps (the gathered dispatch) in CUDA graphs
    and samples what eager decode samples."""
    run_distributed(_graphs_body, 2, backend="nccl")
