"""Weight streaming (``megatron_grpo.rollout.weight_sync``): the bucket plan, the shard rules
against an independent TP split, and trainer -> generator syncs on gloo (2 trainer + 2
generator processes) that must leave the generator's parameters equal, bit for bit, to the
trainer's weights cut to the generator's layout (``tests.megatron_utils.load_full``): TP 2 ->
two TP 1 replicas, TP 1 -> one TP 2 replica, MoE EP 2 -> EP 1 (grouped experts) and
SequentialMLP EP 2 -> grouped experts at TP 2 / expert-TP 2; the old weights stay in place until
``swap``; buckets smaller than a tensor and larger than many."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from megatron_grpo.megatron import ParallelConfig, build_model, unwrap
from megatron_grpo.megatron.parallel import destroy_parallel, initialize_parallel
from megatron_grpo.rollout import EngineOptions, KVCacheEngine, SamplingParams
from megatron_grpo.rollout.weight_sync import (
    TensorMeta,
    WeightReceiver,
    WeightSender,
    plan_buckets,
)
from megatron_grpo.rollout.weight_sync.plan import ALIGN, check_metas
from megatron_grpo.rollout.weight_sync.shards import AxisShard, Coords, SyncTensor
from tests.dist_utils import run_distributed
from tests.megatron_utils import VOCAB, full_params, load_full, tiny_model

# ---------------------------------------------------------------- the bucket plan


def _metas() -> list[TensorMeta]:
    return [
        TensorMeta("big", (10, 6), "torch.float32"),  # 240 bytes, rows of 24
        *(TensorMeta(f"tiny{i}", (3,), "torch.bfloat16") for i in range(5)),  # 6 bytes each
        TensorMeta("wide", (2, 100), "torch.float32"),  # rows of 400 bytes > a 64-byte bucket
    ]


@pytest.mark.parametrize("bucket_bytes", [16, 64, 100, 4096])
def test_buckets_cover_every_row_once_in_order(bucket_bytes):
    metas = _metas()
    buckets = plan_buckets(metas, bucket_bytes)
    seen = {i: [] for i in range(len(metas))}
    for b in buckets:
        end = 0
        for s in b.segments:
            assert s.offset % ALIGN == 0 and s.offset >= end
            end = s.offset + (s.row1 - s.row0) * metas[s.index].row_bytes
            seen[s.index].append((s.row0, s.row1))
        assert b.nbytes == end
        one_row = len(b.segments) == 1 and b.segments[0].row1 - b.segments[0].row0 == 1
        assert b.nbytes <= bucket_bytes or one_row  # only a single row may exceed a bucket
    for i, m in enumerate(metas):
        rows = seen[i]
        assert rows[0][0] == 0 and rows[-1][1] == m.shape[0]
        assert all(a[1] == b[0] for a, b in zip(rows, rows[1:], strict=False))
    if bucket_bytes == 4096:
        assert len(buckets) == 1  # many tiny tensors share one bucket
    if bucket_bytes == 64:
        assert len(seen[0]) > 1  # a tensor larger than a bucket spans several


def test_check_metas_names_the_tensor():
    sent = [
        TensorMeta("a", (4, 2), "torch.float32"),
        TensorMeta("emb", (8, 2), "torch.float32", True),
    ]
    own = {
        "a": TensorMeta("a", (4, 2), "torch.float32"),
        "emb": TensorMeta("emb", (16, 2), "torch.float32", True),
    }
    check_metas(sent, own)  # vocabulary rows may differ (padding per TP size)
    with pytest.raises(ValueError, match="a has global shape"):
        check_metas(sent, {**own, "a": TensorMeta("a", (2, 2), "torch.float32")})
    with pytest.raises(ValueError, match="a is torch.float32 on the trainer and torch.bfloat16"):
        check_metas(sent, {**own, "a": TensorMeta("a", (4, 2), "torch.bfloat16")})
    with pytest.raises(ValueError, match=r"only the generator has \['b'\]"):
        check_metas(sent, {**own, "b": own["a"]})


# ---------------------------------------------------------------- shard rules vs torch.chunk


def _glu_split(full: torch.Tensor, rank: int, size: int, dim: int) -> torch.Tensor:
    gate, up = full.chunk(2, dim=dim)
    return torch.cat([gate.chunk(size, dim=dim)[rank], up.chunk(size, dim=dim)[rank]], dim=dim)


@pytest.mark.parametrize(
    "axes, coords_of",
    [
        ((AxisShard(0, "tp"),), lambda r: Coords(tp=(r, 2))),  # column / vocab / QKV
        ((AxisShard(1, "tp"),), lambda r: Coords(tp=(r, 2))),  # row-parallel
        ((AxisShard(0, "tp", glu=True),), lambda r: Coords(tp=(r, 2))),  # gated fc1
        ((AxisShard(0, "ep"), AxisShard(1, "etp", glu=True)), lambda r: Coords(ep=(r // 2, 2), etp=(r % 2, 2))),
        ((AxisShard(0, "ep"), AxisShard(2, "etp")), lambda r: Coords(ep=(r % 2, 2), etp=(r // 2, 2))),
    ],
)  # fmt: skip
def test_pieces_place_each_rank_shard_where_an_independent_split_takes_it(axes, coords_of):
    full = torch.randn(4, 8, 6)
    ranks = 4 if any(a.dim_of == "ep" for a in axes) else 2
    out = torch.full_like(full, float("nan"))
    for r in range(ranks):
        c = coords_of(r)
        shard = full
        for a in axes:  # the reference split: torch.chunk, gate/up halves for GLU
            rank, size = getattr(c, a.dim_of)
            shard = (
                _glu_split(shard, rank, size, a.dim) if a.glu else shard.chunk(size, a.dim)[rank]
            )
        t = SyncTensor("w", [shard.clone()], False, axes)
        assert t.global_shape(c) == tuple(full.shape)
        for piece in t.pieces(c):
            out[piece.glob] = shard[piece.local]
    assert torch.equal(out, full)


# ---------------------------------------------------------------- trainer -> generators (gloo)

TRAINERS, SOURCE = (0, 1), 0


def _snapshot(chunks) -> list[torch.Tensor]:
    return [p.detach().clone() for p in unwrap(chunks[0]).parameters()]


def _restore(chunks, values: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for p, v in zip(unwrap(chunks[0]).parameters(), values, strict=True):
            p.copy_(v)


def _equal(chunks, values: list[torch.Tensor]) -> list[str]:
    named = list(unwrap(chunks[0]).named_parameters())
    return [n for (n, p), v in zip(named, values, strict=True) if not torch.equal(p, v)]


def _on(par: ParallelConfig, cfg, seed: int, build: bool):
    """Megatron's parallel state for ``par`` on every rank; a model (and its layout) where
    ``build``: trainer and generators are built under their own layouts in turn."""
    destroy_parallel()
    layout = initialize_parallel(par, seed)
    return (build_model(cfg, par, wrap_ddp=False), layout) if build else (None, layout)


def _versions(cfg) -> list[dict[str, torch.Tensor]]:
    """Two versions of the weights at TP = EP = 1 (by name), the same on every rank."""
    first = full_params(_on(ParallelConfig(), cfg, 11, True)[0])
    return [first, {k: v * -1.5 + 0.25 for k, v in first.items()}]


def _sync(rank: int, world: int, case: tuple) -> None:
    trainer_par, gen_par, trainer_cfg, gen_cfg, bucket_bytes = case
    trainer = rank in TRAINERS
    versions = _versions(trainer_cfg)
    # the trainer: version 1 loaded, version 2 kept for the second sync
    chunks, layout = _on(trainer_par, trainer_cfg, 1, trainer)
    if trainer:
        load_full(chunks, versions[1], trainer_cfg)
        second = _snapshot(chunks)
        load_full(chunks, versions[0], trainer_cfg)
    # a generator: built from another seed (its old weights); the expected weights of each
    # version are the TP = 1 weights cut to its layout by load_full
    gen_chunks, gen_layout = _on(gen_par, gen_cfg, 2, not trainer)
    if not trainer:
        expected = []
        old = _snapshot(gen_chunks)
        for v in versions:
            load_full(gen_chunks, v, gen_cfg)
            expected.append(_snapshot(gen_chunks))
        _restore(gen_chunks, old)
    group = dist.new_group([SOURCE, *(r for r in range(world) if r not in TRAINERS)])
    if not trainer:
        decode = gen_par.tensor_model_parallel_size == 1 and gen_cfg.num_moe_experts is None
        _receive(gen_chunks, gen_layout, group, expected, decode)
        return
    sender = WeightSender(chunks, layout, group, SOURCE, bucket_bytes)  # build_model's list
    for version in (1, 2):
        if version == 2:
            _restore(chunks, second)
        metrics = sender.send(version)
        gib = metrics["rollout/weight_sync_gib"]
        assert (gib > 0) == (rank == SOURCE) and metrics["rollout/weight_sync_seconds"] > 0
    if rank == SOURCE and bucket_bytes < 4096:
        assert len(sender.buckets) > len(sender.metas) // 2  # tensors span buckets


def _greedy(model, layout):
    """Greedy tokens of two prompts from a kept engine (its decoder reads the live weights)."""
    engine = KVCacheEngine(model, EngineOptions(decode_path="fused"), layout=layout)
    params = SamplingParams(top_k=1, max_new_tokens=6, eos_id=0, vocab_size=VOCAB, ignore_eos=True)
    return lambda: engine.generate([[5, 6, 7], [8, 9]], params, torch.Generator()).responses


def _receive(chunks, layout, group, expected: list, decode: bool) -> None:
    """Two versions in: the old weights (and with ``decode`` the engine's greedy tokens) stay
    until ``swap``, the expected ones (and their tokens) follow it."""
    greedy = _greedy(unwrap(chunks[0]), layout) if decode else (lambda: None)
    old = _snapshot(chunks)
    tokens = []
    for values in [old, *expected]:
        _restore(chunks, values)
        tokens.append(greedy())
    _restore(chunks, old)
    assert _equal(chunks, expected[0]), "the generator starts from other weights"
    assert not decode or tokens[0] != tokens[1], "the check must see the new weights"
    receiver = WeightReceiver(chunks[0], layout, group, SOURCE)
    for version, want in zip((1, 2), expected, strict=True):
        before, before_tokens = _snapshot(chunks), greedy()
        receiver.begin()
        while not receiver.poll():
            assert not _equal(chunks, before)  # decoding goes on with the old weights
        assert not _equal(chunks, before), "complete, but not swapped in yet"
        assert greedy() == before_tokens
        metrics = receiver.swap()
        assert metrics["version"] == version == receiver.version
        assert not _equal(chunks, want), f"differ after the sync: {_equal(chunks, want)}"
        assert greedy() == tokens[version]  # the kept engine decodes with the new weights
        assert metrics["rollout/weight_sync_gib"] > 0


DENSE = tiny_model()
CASES = {
    "tp2_to_2x_tp1": (ParallelConfig(tensor_model_parallel_size=2), ParallelConfig(), DENSE, DENSE, 1000),
    "tp1_to_tp2": (ParallelConfig(), ParallelConfig(tensor_model_parallel_size=2), DENSE, DENSE, 1 << 20),
}  # fmt: skip
MOE = tiny_model(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32)
SEQUENTIAL = tiny_model(
    num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_grouped_gemm=False
)
MOE_CASES = {
    "ep2_to_2x_ep1": (ParallelConfig(expert_model_parallel_size=2), ParallelConfig(), MOE, MOE, 3000),
    "sequential_ep2_to_grouped_tp2_etp2": (
        ParallelConfig(expert_model_parallel_size=2),
        ParallelConfig(tensor_model_parallel_size=2),
        SEQUENTIAL,
        MOE,
        1 << 20,
    ),
}  # fmt: skip


def _cases(rank: int, world: int, cases: list[tuple]) -> None:
    for case in cases:
        _sync(rank, world, case)
        dist.barrier()


def test_sync_is_bit_exact_tp2_to_tp1_tp1_to_tp2_and_moe_ep2_to_ep1():
    """One spawn of 4 processes (2 trainer, 2 generator ranks) runs every case in turn."""
    run_distributed(_cases, 4, [*CASES.values(), *MOE_CASES.values()])


@pytest.mark.gpu
def test_sync_is_bit_exact_over_nccl_with_decode_graphs():
    """4 GPUs: the same cases over NCCL (the receiver's side stream; bf16; the TP1 replicas'
    engine keeps its CUDA graphs across the swap)."""
    if torch.cuda.device_count() < 4:
        pytest.skip("needs 4 GPUs")
    run_distributed(_cases, 4, [*CASES.values(), *MOE_CASES.values()], backend="nccl")


def _device_sync_while_receiving(rank: int, world: int) -> None:
    """Rank 1 (a generator) begins receiving, frees cached memory and synchronizes its device
    (as the engine does at each call) and only then tells rank 0 (the trainer) to send: a
    bucket broadcast posted before the sender began would hold that synchronization forever."""
    chunks, layout = _on(ParallelConfig(), DENSE, 1 + rank, True)
    sync, notice = dist.new_group([0, 1]), dist.new_group([0, 1], backend="gloo")
    data = dist.new_group([0, 1], backend="gloo")  # the flag and the checksum (CPU)
    flag, total = torch.zeros(1), torch.zeros(1, dtype=torch.float64)
    if rank == 0:
        sender = WeightSender(chunks, layout, sync, SOURCE, notice_group=notice)
        dist.recv(flag, 1, group=data)  # the generator synchronized its device first
        sender.send(7)
        total += sum(p.double().sum() for p in unwrap(chunks[0]).parameters()).cpu()
        dist.send(total, 1, group=data)
        return
    receiver = WeightReceiver(chunks[0], layout, sync, SOURCE, notice)
    receiver.begin()
    assert not receiver.arrived() and not receiver.poll()  # the sender has not begun
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
    dist.send(flag, 0, group=data)
    assert receiver.swap()["version"] == 7 == receiver.version
    dist.recv(total, 0, group=data)
    mine = sum(p.double().sum() for p in unwrap(chunks[0]).parameters()).cpu()
    assert torch.equal(mine, total[0]), (mine, total)


def test_receiver_posts_buckets_only_after_the_header():
    run_distributed(_device_sync_while_receiving, 2)


@pytest.mark.gpu
def test_gpu_device_sync_while_receiving_does_not_wait_for_the_sender():
    """2 GPUs: the same over NCCL, where the early broadcast would deadlock (issue 41)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    run_distributed(_device_sync_while_receiving, 2, backend="nccl", timeout=120)


def test_bench_weight_sync_dry_run(tmp_path):
    """tools/bench_weight_sync.py on CPU (gloo, 2 processes, tiny shapes): its table, and
    every replica checked against the trainer."""
    from tests.test_tools import run_tool

    args = ("--trainer-tp", "1", "--replica-tp", "1")
    stdout = run_tool("bench_weight_sync.py", *args, out=tmp_path, nproc=2)
    assert "model | bucket MiB | GiB | sync s" in stdout
    rows = json.loads(next(tmp_path.glob("bench_weight_sync_*.json")).read_text())["results"]
    assert rows and all(r["ok"] and r["buckets"] > 1 for r in rows)
