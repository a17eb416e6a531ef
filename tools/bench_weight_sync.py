"""Weight sync (``megatron_grpo.rollout.weight_sync``): trainer -> generation replicas, timed.

The first ``--trainer-tp`` ranks are one trainer replica (TP, random bf16 weights, no optimizer
state); the other ranks are generation replicas of ``--replica-tp``. Per model shape (Qwen3-0.6B,
Qwen3-8B) and bucket size: one warm-up sync, then ``--iters`` timed ones (all ranks start each
together); one table row each with the median sender seconds (gather + broadcast until complete:
``rollout/weight_sync_seconds``), GiB sent and GiB/s, the generators' receive seconds (begin to
complete) and swap seconds (the copy into the live parameters, the only stop of generation);
``ok``: after the last sync every replica's per-tensor float64 sums (real vocabulary rows) equal
the trainer's (the bit-exact checks are tests/test_weight_sync.py's).

On 4 GPUs (issue 41's targets: 0.6B <= 0.15 s, 8B <= 1.5 s; trainer TP2 -> one TP2 replica)::

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 4 tools/bench_weight_sync.py --out $OUT
    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 4 tools/bench_weight_sync.py --replica-tp 1 \
        --out $OUT   # two TP1 replicas

CPU dry run (gloo, tiny shapes): ``torchrun --nproc-per-node 2 tools/bench_weight_sync.py
--device cpu --trainer-tp 1 --replica-tp 1 --out /tmp/x``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch.distributed as dist

PRESETS = {  # Qwen3 shapes
    "qwen3_0p6b": dict(num_layers=28, hidden_size=1024, num_attention_heads=16,
                       num_query_groups=8, kv_channels=128, ffn_hidden_size=3072,
                       share_embeddings_and_output_weights=True, vocab_size=151936),
    "qwen3_8b": dict(num_layers=36, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                     kv_channels=128, ffn_hidden_size=12288, vocab_size=151936),
    "tiny": dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                 ffn_hidden_size=128, vocab_size=1000),
}  # fmt: skip


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["qwen3_0p6b", "qwen3_8b"], choices=PRESETS)
    p.add_argument("--trainer-tp", type=int, default=2)
    p.add_argument("--replica-tp", type=int, default=2)
    p.add_argument("--bucket-mib", type=float, nargs="+", default=[256, 1024])
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.device == "cpu" and args.models == p.get_default("models"):
        args.models, args.bucket_mib, args.iters = ["tiny"], [0.01], 2
    return args


def model_config(name: str, args: argparse.Namespace):
    from megatron_grpo.megatron import ModelConfig

    return ModelConfig(
        max_sequence_length=4096, layernorm_epsilon=1e-6, qk_layernorm=True,
        rotary_base=1000000, transformer_impl="local",
        params_dtype="bfloat16" if args.device == "cuda" else "float32", **PRESETS[name],
    )  # fmt: skip


def build(cfg, tp: int, seed: int, mine: bool):
    """Megatron's parallel state at TP ``tp`` on every rank; the model where ``mine``."""
    from megatron_grpo.megatron import ParallelConfig, build_model, unwrap
    from megatron_grpo.megatron.parallel import destroy_parallel, initialize_parallel

    destroy_parallel()
    par = ParallelConfig(tensor_model_parallel_size=tp)
    layout = initialize_parallel(par, seed)
    model = unwrap(build_model(cfg, par, wrap_ddp=False)[0]) if mine else None
    return model, layout


def digest(model, layout, vocab: int) -> list[float]:
    """Per global tensor, the float64 sum of its elements over this rank's model replica (real
    vocabulary rows only: the padding differs between TP sizes), reduced over the replica's TP
    group: the trainer's and every generator replica's must agree (to float64 rounding)."""
    from megatron_grpo.rollout.weight_sync.shards import Coords, sync_tensors

    coords = Coords.of(model, layout)
    sums = []
    for t in sync_tensors(model):
        total = torch.zeros((), dtype=torch.float64, device=t.params[0].device)
        if t.kind != "replicated" or layout.tp_rank == 0:  # count replicated tensors once
            local = t.local()
            for piece in t.pieces(coords):
                block, rows = local[piece.local], piece.glob[0]
                if t.vocab:
                    block = block[: max(0, min(rows.stop, vocab) - rows.start)]
                total += block.double().sum()
        sums.append(total)
    out = torch.stack(sums)
    if layout.tp_group is not None:
        dist.all_reduce(out, group=layout.tp_group)
    return out.tolist()


def run_model(name: str, args: argparse.Namespace, world: int, rank: int) -> list[dict]:
    """This rank's rows (one per bucket size): medians of its side's metrics, and whether
    the last sync left every replica with the trainer's weights."""
    from megatron_grpo.rollout.weight_sync import WeightReceiver, WeightSender

    cfg = model_config(name, args)
    trainer = rank < args.trainer_tp
    model, layout = build(cfg, args.trainer_tp, 1, trainer)
    gen_model, gen_layout = build(cfg, args.replica_tp, 2, not trainer)
    group = dist.new_group([0, *range(args.trainer_tp, world)])
    rows = []
    for mib in args.bucket_mib:
        if trainer:
            side = WeightSender(model, layout, group, 0, int(mib * (1 << 20)))
        else:
            side = WeightReceiver(gen_model, gen_layout, group, 0)
        metrics = []
        for version in range(args.iters + 1):  # the first: warm-up
            if trainer:
                with torch.no_grad():  # a new version: the weights change every step
                    for p in model.parameters():
                        p.add_(1.0)
            dist.barrier()
            if trainer:
                metrics.append(side.send(version))
            else:
                side.begin()
                metrics.append(side.swap())
                assert metrics[-1]["version"] == version, metrics[-1]
        mine = digest(model, layout, cfg.vocab_size) if trainer else None
        if not trainer:
            mine = digest(gen_model, gen_layout, cfg.vocab_size)
        row = {"model": name, "bucket_mib": mib, "buckets": len(side.buckets), "digest": mine}
        for key in metrics[0]:
            row[key] = statistics.median(m[key] for m in metrics[1:])
        rows.append(row)
        del side
    return rows


def main() -> None:
    args = parse()
    if args.device == "cpu":
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    from megatron_grpo.megatron.parallel import destroy_parallel

    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world <= args.trainer_tp or (world - args.trainer_tp) % args.replica_tp:
        raise SystemExit(
            f"world {world}: needs --trainer-tp {args.trainer_tp} ranks plus a multiple of "
            f"--replica-tp {args.replica_tp} generator ranks"
        )
    report = {"world": world, "trainer_tp": args.trainer_tp, "replica_tp": args.replica_tp}
    results = []
    for name in args.models:
        rows = run_model(name, args, world, rank)
        gathered = [None] * world
        dist.all_gather_object(gathered, rows)
        results += merge(gathered, args.trainer_tp)
        destroy_parallel()
    if rank == 0:
        if args.device == "cuda":
            report["gpus"] = torch.cuda.get_device_name(0)
        report["results"] = results
        print_table(results)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            path = os.path.join(args.out, f"bench_weight_sync_w{world}_r{args.replica_tp}.json")
            with open(path, "w") as f:
                json.dump(report, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def merge(per_rank: list[list[dict]], trainer_ranks: int) -> list[dict]:
    """One row per (model, bucket): the source's send seconds, the slowest receiver's receive
    and swap seconds, and ``ok``: every generator rank's digest equals the source's."""
    out = []
    for i, row in enumerate(per_rank[0]):
        recv = [r[i] for r in per_rank[trainer_ranks:]]
        want = torch.tensor(row["digest"])
        ok = all(
            torch.allclose(torch.tensor(r["digest"]), want, rtol=1e-9, atol=1e-6) for r in recv
        )
        merged = {k: v for k, v in row.items() if k != "digest"}
        merged.update(
            receive_seconds=max(r["rollout/weight_sync_seconds"] for r in recv),
            swap_seconds=max(r["rollout/weight_swap_seconds"] for r in recv),
            ok=ok,
        )
        out.append(merged)
    return out


def print_table(rows: list[dict]) -> None:
    head = "model | bucket MiB | GiB | sync s | GiB/s | receive s | swap s | ok"
    print(head, flush=True)
    for r in rows:
        s = r["rollout/weight_sync_seconds"]
        print(
            f"{r['model']} | {r['bucket_mib']:g} | {r['rollout/weight_sync_gib']:.3f} | {s:.4f} | "
            f"{r['rollout/weight_sync_gib'] / s:.1f} | {r['receive_seconds']:.4f} | {r['swap_seconds']:.4f} | "
            f"{r['ok']}",
            flush=True,
        )


if __name__ == "__main__":
    main()
