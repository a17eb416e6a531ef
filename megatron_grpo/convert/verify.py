"""``--verify``: logits of transformers vs the converted Megatron model, fp32, same prompts.

Both sides run in float32 whatever the checkpoint dtype (bf16 weights upcast exactly), so the
difference measures the conversion, not the precision. When the conversion cast the weights
(``--dtype``: ``hf-to-mcore`` wrote the Megatron checkpoint, ``mcore-to-hf`` the HF model, in
another dtype than their source), both models get their weights rounded to that dtype first: the
side written in it is unchanged (rounding is exact there), the other one then holds the same
values, and the default tolerance applies unchanged. Without that, an fp32 model written as bf16
differs by the cast's own rounding (a few 1e-3 to 1e-2 in the logits), not by a conversion error.
Prompts come from the checkpoint's tokenizer when it has one, else fixed random token ids.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import socket
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_grpo.convert.errors import ConversionError
from megatron_grpo.convert.layout import MODEL_CONFIG_NAME, read_model_config
from megatron_grpo.convert.mcore_io import cpu_moe_overrides, single_process_megatron
from megatron_grpo.warning_log import run_collecting

PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:",
    "Question: what is 17 * 23? Answer:",
)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def prompt_ids(hf_dir: str | Path, vocab_size: int, seq_len: int = 16) -> list[torch.Tensor]:
    """Token ids ``[S]`` per prompt: tokenized PROMPTS, or 3 seeded random sequences."""
    hf_dir = Path(hf_dir)
    if any((hf_dir / f).is_file() for f in _TOKENIZER_FILES):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(hf_dir), local_files_only=True)
        ids = [torch.tensor(tok(p)["input_ids"], dtype=torch.long) for p in PROMPTS]
        if max(int(t.max()) for t in ids) >= vocab_size:
            raise ConversionError(f"the tokenizer emits ids >= vocab_size={vocab_size}")
        return ids
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab_size, (seq_len,), generator=gen) for _ in PROMPTS]


def round_weights(model: torch.nn.Module, dtype: torch.dtype | None) -> None:
    """Round every parameter of ``model`` to ``dtype`` and back in place (None: unchanged)."""
    if dtype is None:
        return
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(dtype).to(p.dtype))


def hf_logits(
    hf_dir: str | Path, ids: list[torch.Tensor], weight_dtype: torch.dtype | None = None
) -> list[torch.Tensor]:
    """transformers forward, fp32, eager attention: ``[S, V]`` logits per prompt;
    ``weight_dtype``: the weights rounded to it first (the checkpoint's dtype)."""
    import transformers
    from transformers import AutoModelForCausalLM

    major = int(transformers.__version__.split(".")[0])
    dtype_kw = {"dtype" if major >= 5 else "torch_dtype": torch.float32}
    model = AutoModelForCausalLM.from_pretrained(
        str(hf_dir), attn_implementation="eager", local_files_only=True, **dtype_kw
    ).eval()
    round_weights(model, weight_dtype)
    with torch.no_grad():
        return [model(t[None]).logits[0].float() for t in ids]


def load_megatron_model(
    ckpt_dir: str | Path, weight_dtype: torch.dtype | None = None
) -> torch.nn.Module:
    """The GPTModel of ``ckpt_dir`` at the initialized TP, fp32, weights loaded through
    ``dist_checkpointing`` (resharding to this TP) and rounded to ``weight_dtype`` when given.
    Call after ``initialize_parallel``."""
    from megatron.core import dist_checkpointing

    from megatron_grpo.megatron.config import ParallelConfig, to_transformer_config
    from megatron_grpo.megatron.layout import ParallelLayout
    from megatron_grpo.megatron.model.build import build_model, unwrap
    from megatron_grpo.megatron.parallel import cuda_compat

    ckpt_dir = Path(ckpt_dir)
    cfg = dataclasses.replace(
        read_model_config(ckpt_dir / MODEL_CONFIG_NAME), params_dtype="float32"
    )
    tp = ParallelLayout.current(sequence_parallel=False).tp_size
    par = ParallelConfig(tensor_model_parallel_size=tp)
    tcfg = to_transformer_config(cfg, par, params_dtype=torch.float32, extra=cpu_moe_overrides(cfg))
    model = unwrap(build_model(cfg, par, wrap_ddp=False, transformer_config=tcfg)[0])
    with cuda_compat():
        state = dist_checkpointing.load(model.sharded_state_dict(), str(ckpt_dir))
    model.load_state_dict(state)
    round_weights(model, weight_dtype)
    return model.eval()


def model_logits(model: torch.nn.Module, vocab_size: int, ids: list[torch.Tensor]) -> list:
    """Full-vocabulary ``[S, vocab_size]`` logits per prompt (vocab-parallel output gathered)."""
    from megatron.core import tensor_parallel

    device = next(model.parameters()).device
    out = []
    with torch.no_grad():
        for t in ids:
            x = t[None].to(device)
            pos = torch.arange(x.shape[1], device=device)[None]
            logits = model(input_ids=x, position_ids=pos, attention_mask=None)  # [1, S, V_pad/TP]
            full = tensor_parallel.gather_from_tensor_model_parallel_region(logits)
            out.append(full[0, :, :vocab_size].float().cpu())
    return out


def megatron_logits(
    ckpt_dir: str | Path, ids: list[torch.Tensor], weight_dtype: torch.dtype | None = None
) -> list[torch.Tensor]:
    """Megatron GPTModel forward at the initialized TP, fp32: ``[S, V]`` logits per prompt;
    ``weight_dtype``: the weights rounded to it first."""
    vocab_size = read_model_config(Path(ckpt_dir) / MODEL_CONFIG_NAME).vocab_size
    return model_logits(load_megatron_model(ckpt_dir, weight_dtype), vocab_size, ids)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_WORKER = f"{__name__}:_worker"  # run_collecting imports it in the spawned process


def _worker(
    rank: int, world: int, port: int, ckpt_dir: str, ids: list, weight_dtype, results
) -> None:
    from megatron_grpo.megatron.config import ParallelConfig
    from megatron_grpo.megatron.parallel import initialize_parallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank))
    os.environ.update(WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    try:
        initialize_parallel(ParallelConfig(tensor_model_parallel_size=world), seed=0)
        logits = megatron_logits(ckpt_dir, ids, weight_dtype)
        if rank == 0:  # numpy: plain pickling, no shared-memory handles outliving the worker
            results.put(("ok", [t.numpy() for t in logits]))
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put(("error", f"rank {rank}:\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn_megatron_logits(
    ckpt_dir: str | Path,
    ids: list[torch.Tensor],
    tp: int,
    weight_dtype: torch.dtype | None = None,
) -> list:
    """:func:`megatron_logits` at tensor-parallel size ``tp`` in ``tp`` spawned processes."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(
            target=run_collecting,
            args=(_WORKER, r, tp, port, str(ckpt_dir), ids, weight_dtype, results),
        )
        for r in range(tp)
    ]
    for p in procs:
        p.start()
    try:
        while True:
            try:
                status, payload = results.get(timeout=5)
                break
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    raise ConversionError("a verification worker died") from None
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.terminate()
    if status != "ok":
        raise ConversionError(f"verification failed in a worker: {payload}")
    return [torch.from_numpy(a) for a in payload]


def verify_conversion(
    hf_dir: str | Path, ckpt_dir: str | Path, tp: int = 1, weight_dtype: torch.dtype | None = None
) -> float:
    """Max absolute logit difference between transformers (``hf_dir``) and the Megatron
    checkpoint ``ckpt_dir`` loaded at tensor-parallel size ``tp``; with ``weight_dtype`` (the
    dtype a conversion cast the weights to) both models' weights are rounded to it first."""
    from megatron_grpo.megatron.config import ParallelConfig, check_parallel

    model_cfg = read_model_config(Path(ckpt_dir) / MODEL_CONFIG_NAME)
    try:
        check_parallel(model_cfg, ParallelConfig(tensor_model_parallel_size=tp), world_size=tp)
    except ValueError as e:
        raise ConversionError(f"cannot verify at TP={tp}: {e}") from e
    ids = prompt_ids(hf_dir, model_cfg.vocab_size)
    ref = hf_logits(hf_dir, ids, weight_dtype)
    if tp == 1:
        with single_process_megatron():
            got = megatron_logits(ckpt_dir, ids, weight_dtype)
    else:
        got = spawn_megatron_logits(ckpt_dir, ids, tp, weight_dtype)
    return max(float((a - b).abs().max()) for a, b in zip(ref, got, strict=True))


def check_logits(
    hf_dir: str | Path,
    ckpt_dir: str | Path,
    tp: int,
    tol: float,
    weight_dtype: torch.dtype | None = None,
) -> float:
    """:func:`verify_conversion`, printed (with the dtype both sides were rounded to, when
    ``weight_dtype`` is given); above ``tol`` (or NaN) is a ConversionError."""
    diff = verify_conversion(hf_dir, ckpt_dir, tp=tp, weight_dtype=weight_dtype)
    how = f"TP={tp}"
    if weight_dtype is not None:
        name = str(weight_dtype).removeprefix("torch.")
        how += f", both with weights rounded to {name} as --dtype wrote them"
    print(f"verify: max |logit difference| transformers vs Megatron ({how}): {diff:.3e}")
    if not diff <= tol:
        raise ConversionError(f"verification failed: max logit difference {diff:.3e} > {tol}")
    return diff
