"""The KV-cached generation engine over the training model's own weights.

A call packs the ragged prompts into THD prefill forwards that fill the KV cache (one slot per
sequence), then runs decode steps: one token per unfinished sequence, attending to its slot.

* Slots: the cache holds ``min(samples, budget / bytes per sequence)`` sequences; the budget is
  ``kv_cache_gib`` when set, else sized from the GPU's memory at each call (see
  ``EngineOptions.kv_cache_fraction``; the ranks of a TP / EP group agree on the smallest).
  Waiting samples are admitted (prefilled) into free slots as soon as enough are free, so
  generation that does not fit runs as a stream rather than in lock-step waves.
* Finished sequences stop costing compute: their slot is refilled by moving the last active
  slot into it (compaction), so a decode step runs over exactly the unfinished rows (rounded up
  to a power of two when CUDA graphs are on) and a long tail of lengths does not keep the batch.
* Decode steps run the fused path (``fused_decode``: the same weights, ~9 kernels a layer)
  where it covers the model, else megatron-core's layer modules; ``self.decode`` says which.
* Decode reads keys ``[0, ctx)`` with ctx the longest row's length rounded up to
  ``context_bucket`` (graph shapes), masking each row to its own length.
* TP: SP off while generating; every TP rank draws the same tokens (``tp_sampling``); the
  fused step's sums go through ``tp_all_reduce``. DP: each rank its own prompts. EP: every MoE
  forward is a collective of the expert group (one all-reduce MAX per prefill and segment of
  ``ep_decode_steps`` decode steps, padded to the group's sizes, dummy rows until the group is
  done). PP and CP > 1 are refused.
* The cache is freed when the call returns, its memory back to the driver (``memory_release``;
  with graphs, mapped at one reserved address: ``fixed_address``); a CUDA graph pool and a few
  static buffers stay with the engine.
"""

from __future__ import annotations

import contextlib
import functools
import time
import warnings
import weakref
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from megatron_grpo.megatron.layout import ParallelLayout
from megatron_grpo.megatron.moe.ep_dispatch import no_host_sync
from megatron_grpo.megatron.parallel import all_reduce_max
from megatron_grpo.rollout.engine import fused_decode as fd
from megatron_grpo.rollout.engine import kv_cache as kvc
from megatron_grpo.rollout.engine import memory_release
from megatron_grpo.rollout.engine import model_io as io
from megatron_grpo.rollout.engine.cached_attention import attached
from megatron_grpo.rollout.engine.decode_overlap import HalvesReduce
from megatron_grpo.rollout.engine.graphs import DecodeGraphs, graph_batch
from megatron_grpo.rollout.engine.options import EngineOptions
from megatron_grpo.rollout.engine.params import SamplingParams
from megatron_grpo.rollout.engine.requests import Request, restore_kv, start_run, write_back
from megatron_grpo.rollout.engine.routes import RouteLog, recording
from megatron_grpo.rollout.engine.run_state import Generation, Launched, Run
from megatron_grpo.rollout.engine.tp_sampling import next_tokens


class KVCacheEngine:
    """``KVCacheEngine(model, options).generate(prompts, params, generator)``; keep one per
    model so its CUDA graphs are captured once and reused across calls."""

    def __init__(
        self,
        model: torch.nn.Module,
        options: EngineOptions | None = None,
        max_context: int | None = None,
        layout: ParallelLayout | None = None,
    ) -> None:
        """``max_context``: the longest prompt + response any call will bring (the trainer's
        ``max_prompt_length + max_response_length``): the first cache is sized for it, so a
        later call with a longer prompt does not re-allocate once training state holds the
        memory (fewer slots). None: each call's own longest. ``layout``: this rank's (None:
        read once here from the initialized parallel state)."""
        self.model = model
        if layout is None:
            layout = ParallelLayout.current(model.config.sequence_parallel)
        self.layout = layout
        self.options = o = options or EngineOptions()
        device = io.model_device(model)
        self.decode = plan = fd.engine_plan(model, o, self.layout, device)
        use = plan.graphs
        self.graphs = DecodeGraphs() if use else None
        # (hidden [b, H], uniforms [b], params) -> tokens, log-probs [b], the same on TP ranks
        kw = dict(layout=self.layout, choice=o.tp_sampling, rows_kernel=plan.kernels.sample_rows)
        self._next_tokens = functools.partial(next_tokens, model, **kw)
        self.sizer = kvc.CacheSizer(model, o, self.layout, max_context, use)
        self._fused: fd.FusedDecoder | None = None
        self._all_reduce: HalvesReduce | None = None  # built at the first call (a collective)
        self.cache: kvc.KVCache | None = None
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None
        self._static_key: tuple | None = None
        self._rows_moved, self._meta_rows = True, 0  # the host's rows vs the device's meta
        self.stats: dict[str, float] = {}

    @property
    def use_graphs(self) -> bool:
        """Whether decode steps replay CUDA graphs (the decode plan's decision)."""
        return self.decode.graphs

    @property
    def graphs_off(self) -> str:
        """Why graphs are off where auto would have them on ("" otherwise)."""
        return self.decode.graphs_off

    # ------------------------------------------------------------------ public
    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        generator: torch.Generator,
        record_routes: bool = False,
        limits: list[int | None] | None = None,
        uniforms: torch.Tensor | None = None,
    ) -> Generation:
        """Responses and log-probs, and with ``record_routes`` per sample its routes
        ``[P + R, L, k]`` (MoE only; ``megatron_grpo.rollout.engine.routes``). ``limits``: per
        sample its own response limit (None: ``params.max_new_tokens``). ``uniforms``: each
        sample's uniform numbers ``[N, max_new_tokens]`` (None: drawn from ``generator``)."""
        io.check_layout(self.layout)
        io.check_prompts(prompts, params, self.model.max_sequence_length)
        device = io.model_device(self.model)
        if uniforms is None:
            uniforms = torch.rand(len(prompts), params.max_new_tokens, generator=generator)
        run = Run.start(prompts, params, uniforms.to(device), limits)
        if record_routes:
            run.routes = RouteLog(self.model, run.prompts, params.max_new_tokens)
        self._reset_stats()
        with self._generation_mode(run), recording(run.routes):
            self._loop(run)
        return Generation.of(*run.results(), run.routes)

    @torch.no_grad()
    def run_requests(
        self,
        requests: list[Request],
        params: SamplingParams,
        version: int,
        stop: Callable[[torch.Tensor], bool] | None = None,
        keep_kv: bool = False,
        record_routes: bool = False,
        check_every: int | None = None,
    ) -> None:
        """Continue ``requests`` (none finished; ``megatron_grpo.rollout.engine.requests``) until all
        finished or ``stop(finished [N] bool)`` is true between engine steps (an expert group
        stops when all its ranks' ``stop`` are; asked when a row finishes or, with
        ``check_every``, at least every that many decode steps); new tokens are tagged ``version``. Paused
        requests keep their cached rows on the host with ``keep_kv``; with ``record_routes``
        each request's ``routes`` hold its fed positions' routes (carried ones kept)."""
        io.check_layout(self.layout)
        io.check_prompts([r.prompt for r in requests], params, self.model.max_sequence_length)
        run = start_run(requests, params, io.model_device(self.model))
        if record_routes:
            run.routes = RouteLog(self.model, run.prompts, params.max_new_tokens)
            for i, r in enumerate(requests):
                if r.routes is not None:
                    run.routes.restore(i, r.routes)
        self._reset_stats()
        with self._generation_mode(run), recording(run.routes):
            self.stats["kv_recomputed"] = restore_kv(run, requests, self.cache.kv)
            self._rows_moved = True
            self._loop(run, stop, check_every)
            write_back(run, requests, version)
            if keep_kv:
                for slot, i in enumerate(run.rows):
                    r = requests[i]
                    r.kv = self.cache.kv[:, :, slot, :, : r.fed].to("cpu", copy=True)
        if run.routes is not None:
            for i, r in enumerate(requests):
                r.routes = run.routes.sample_rows(i, len(r.prompt) + len(r.tokens))

    def _reset_stats(self) -> None:
        names = "prefill_forwards decode_steps decode_rows decode_live_rows generated_tokens"
        names += " prefill_seconds decode_seconds kv_recomputed graph_captures"
        self.stats = dict.fromkeys(names.split(), 0)
        self._captures_before = 0 if self.graphs is None else self.graphs.captures

    # ------------------------------------------------------------------ setup
    @contextlib.contextmanager
    def _generation_mode(self, run: Run) -> Iterator[None]:
        """Eval mode, SP off, the cache allocated and attached; all undone."""
        model, cfg = self.model, self.model.config
        was_training, sp = model.training, cfg.sequence_parallel
        model.eval()
        if sp:
            io.set_sequence_parallel(model, False)
        try:
            kept, self.cache = self.cache, None
            self.cache = self.sizer.allocate(run.prompts, run.params.max_new_tokens, kept)
            self.stats["slots"] = self.cache.slots
            self.stats["kv_cache_gib"] = (
                self.cache.kv.numel() * self.cache.kv.element_size() / 2**30
            )
            self.cache.attention = self.decode.attention
            self._prepare_static(run)
            self._rows_moved = True
            with attached(model, self.cache):
                yield
        finally:
            if not self.options.keep_cache:  # freed and released before any policy update
                self._drop_cache()
            if sp:
                io.set_sequence_parallel(model, True)
            model.train(was_training)

    def _drop_cache(self) -> None:
        """Free the cache and return its memory to the driver (``memory_release``): kept by
        the allocator, the update's long-lived tensors would land in it and pin it."""
        if self.cache is None:
            return
        dropped = weakref.ref(self.cache.kv)
        device = self.cache.kv.device
        self.cache = None
        released = memory_release.release(device, dropped)  # e.g. an exception's frames hold it
        if not (self.sizer.release() and released):
            warnings.warn("the KV cache is still referenced after the call", stacklevel=2)

    def _prepare_static(self, run: Run) -> None:
        """Static decode inputs/outputs, the RoPE table and the fused decoder's weights: what a
        captured graph reads and writes. Graphs are dropped when any of them, the cache or a
        parameter's storage moved (weights updated in place keep them valid)."""
        device, cache = io.model_device(self.model), self.cache
        weights = tuple(p.data_ptr() for p in self.model.parameters())
        key = (cache.slots, cache.seq_len, cache.kv.data_ptr(), weights)
        changed = key != self._static_key
        if self.graphs is not None:  # re-captured by every rank of the graphs' collectives
            groups = (self.layout.tp_group, self.layout.expert_tp_ep_group)
            changed = self.graphs.agree_recapture(changed, groups)
        if not changed:
            return
        if self.decode.path == "fused":
            tp, d = self.layout.tp_group, self.decode
            self._all_reduce = self._all_reduce or HalvesReduce.build(
                tp, d.all_reduce, d.overlap_rows, device
            )
            self._fused = fd.FusedDecoder(self.model, d.kernels, tp, self._all_reduce)
        self._meta = torch.zeros(4, cache.slots, dtype=torch.long, device=device)
        self._u = torch.zeros(cache.slots, dtype=torch.float32, device=device)
        self._out = torch.zeros(2, cache.slots, dtype=torch.float64, device=device)
        pin = device.type == "cuda"
        self._host_out = [
            torch.zeros(2, cache.slots, dtype=torch.float64, pin_memory=pin) for _ in range(2)
        ]
        self._rope = io.rope_table(self.model, cache.seq_len)
        cache.rotary_interleaved = bool(self.model.config.rotary_interleaved)
        self._static_key = key
        if self.graphs is not None:
            self.graphs.clear()

    # ------------------------------------------------------------------ the loop
    def _loop(self, run: Run, stop: Callable | None = None, every: int | None = None) -> None:
        group = self.layout.expert_tp_ep_group
        while True:
            if stop is not None and self._stopping(run, stop, group):
                return
            new = self._admit(run)
            tokens = sum(run.prefix_len(i) for i in new)
            if group is not None:  # EP: one agreement an iteration (one host round trip)
                work = int(bool(new or run.rows or run.waiting))
                # + the decode steps' rows and longest context (rows finishing at prefill: pad)
                # and how many steps run before the next agreement (the group's fewest)
                bounds = [work, tokens, len(run.rows) + len(new), run.longest(new)]
                bounds.append(-min(run.steps_left(new), self._segment(run, new, stop, every)))
                work, tokens, rows, longest, steps = all_reduce_max(bounds, group, torch.int64)
                if not work:
                    return
            elif not (new or run.rows or run.waiting):
                return
            t0 = time.perf_counter()
            if tokens:
                self._prefill(run, new, tokens if group is not None else None)
            t1 = time.perf_counter()
            if group is not None:  # EP: the group's agreed steps, one in flight
                if rows:
                    self._decode_steps(run, rows, longest, -steps)
            elif run.rows and (self._admissible(run) or run.routes is not None):
                # One step, then admit the waiting; routes are recorded step by step, as the
                # rows are fed (a step ahead would route rows that already finished).
                self._decode(run, len(run.rows))
            elif run.rows:
                self._decode_stream(run, every if stop is not None else None)
            self.stats["prefill_seconds"] += t1 - t0
            self.stats["decode_seconds"] += time.perf_counter() - t1
            if self.graphs is not None:  # re-captured when the cache or a weight moved
                self.stats["graph_captures"] = self.graphs.captures - self._captures_before

    @staticmethod
    def _stopping(
        run: Run, stop: Callable[[torch.Tensor], bool], group: dist.ProcessGroup | None
    ) -> bool:
        """``stop`` (between engine steps); an expert group stops when every rank would (one
        keeps generating for the others meanwhile: its finished requests wait for later)."""
        local = bool(stop(run.finished))
        if group is None:
            return local
        return all_reduce_max([int(not local)], group, torch.int64)[0] == 0

    def _admissible(self, run: Run, admitted: int = 0) -> bool:
        """Waiting samples are admitted once a quarter of the slots (or every waiting sample's
        worth, or the whole cache) is free (``admitted``: slots just taken, not yet rows)."""
        free = self.cache.slots - len(run.rows) - admitted
        return bool(run.waiting) and free >= min(len(run.waiting), max(1, self.cache.slots // 4))

    def _admit(self, run: Run) -> list[int]:
        """Waiting samples to prefill now: when a quarter of the slots (or every waiting sample,
        or the whole cache) is free, up to ``max_prefill_tokens`` of prompts."""
        if not self._admissible(run):
            return []
        free = self.cache.slots - len(run.rows)
        new, tokens = [], 0
        while run.waiting and len(new) < free:
            n = run.prefix_len(run.waiting[0])
            if new and tokens + n > self.options.max_prefill_tokens:
                break
            new.append(run.waiting.popleft())
            tokens += n
        return new

    def _prefill(self, run: Run, new: list[int], num_tokens: int | None) -> None:
        """Prefill ``new`` into slots after the active rows; sample the first tokens of the
        fresh ones (resumed requests are prefilled up to their last token, which decode feeds)."""
        seqs = [run.prefix(i) for i in new] or [[0]]  # a dummy document keeps EP in step
        ids, pos, packed = io.packed_inputs(seqs, 1, num_tokens)
        slot = torch.full_like(pos[0], self.cache.scratch)
        first = len(run.rows)
        for j, s in enumerate(seqs if new else []):
            start = int(packed.cu_seqlens_q[j])
            slot[start : start + len(s)] = first + j
        device = io.model_device(self.model)
        ids, pos, packed = ids.to(device), pos.to(device), io.packed_to(packed, device)
        self.cache.plan_prefill(packed, slot.to(device), pos[0])
        hidden = self._forward(ids, pos)[packed.cu_seqlens_q[1:].long() - 1, 0]
        fresh = [j for j, i in enumerate(new) if run.lengths[i] == 0]
        if run.routes is not None:  # document j is sample new[j]; a dummy one is dropped
            # a resumed request's routes are the carried ones (the forwards that fed them)
            starts = [0 if run.lengths[i] == 0 else len(s) for i, s in zip(new, seqs, strict=False)]
            run.routes.packed(new, packed.cu_seqlens_q, starts)
        self.stats["prefill_forwards"] += 1
        if device.type == "cuda":
            self.stats["prefill_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        if not new:
            return
        run.rows.extend(new)
        self._rows_moved = True
        if not fresh:
            return
        if len(fresh) < len(new):
            hidden = hidden[fresh]
        sampled = [new[j] for j in fresh]
        tokens, logp = self._next_tokens(hidden, run.uniforms[sampled, 0], run.params)
        done = run.record(torch.tensor(sampled), tokens.cpu(), logp.cpu())
        self.stats["generated_tokens"] += len(sampled)
        self._retire(run, [first + fresh[j] for j in done.nonzero()[:, 0].tolist()])

    def _decode(self, run: Run, rows: int) -> None:
        """One token for every active row."""
        step = self._launch(run, rows)
        self._retire(run, self._collect(run, step), step.ctx)

    def _segment(self, run: Run, new: list[int], stop: Callable | None, every: int | None) -> int:
        """Decode steps between two agreements of the expert group (``ep_decode_steps``; 1
        while routes are recorded or more waiting samples could be admitted (``new``: those
        admitted now), as at EP 1; at most ``every`` between ``stop`` checks)."""
        if run.routes is not None or self._admissible(run, len(new)):
            return 1
        steps = self.options.ep_decode_steps
        return min(steps, every) if stop is not None and every else steps

    def _decode_steps(self, run: Run, rows: int, longest: int, steps: int) -> None:
        """``steps`` decode steps of the expert group's padded batch of ``rows`` (``longest``:
        the group's longest sequence after the first), each launched before the last one's
        tokens reach the host. Rows that stop stay in the batch (padding: their tokens are
        dropped) and retire after the last step; ``steps`` never passes a row's limit."""
        finished: list[int] = []
        launched = [self._launch(run, rows, longest=longest)]
        for k in range(1, steps + 1):
            if k < steps:
                launched.append(self._launch(run, rows, longest=longest + k))
            finished += self._collect(run, launched[k - 1], skip=finished)
        self._retire(run, sorted(finished), launched[-1].ctx)

    def _decode_stream(self, run: Run, steps: int | None = None) -> None:
        """Decode steps with one in flight until a row finishes (or ``steps`` ran): step t + 1
        is launched before step t's tokens reach the host (the device advances the rows' state),
        so the host's bookkeeping hides behind the GPU. Rows finished at step t also ran step
        t + 1, whose tokens for them are dropped."""
        prev, n = self._launch(run, len(run.rows)), 2
        while True:
            nxt = self._launch(run, len(run.rows), ahead=1)
            finished = self._collect(run, prev)
            if finished or (steps is not None and n >= steps):
                finished += self._collect(run, nxt, skip=finished)
                self._retire(run, sorted(finished), nxt.ctx)
                return
            prev, n = nxt, n + 1

    def _launch(self, run: Run, rows: int, ahead: int = 0, longest: int | None = None) -> Launched:
        """Enqueue one decode step of the active rows (``ahead`` steps of theirs are still in
        flight) and the copy of its tokens to the host. ``longest``: the group's (EP: its graphs
        hold collectives, so every rank replays the same context's graph)."""
        n = len(run.rows)
        b = graph_batch(rows, self.cache.slots) if self.use_graphs else rows
        samples = torch.tensor(run.rows, dtype=torch.long)
        if longest is None:
            longest = int((run.prompt_lens[samples] + run.lengths[samples]).max()) if n else 1
            longest += ahead
        ctx = min(
            -(-longest // self.options.context_bucket) * self.options.context_bucket,
            self.cache.seq_len,
        )
        if self._rows_moved or b != self._meta_rows:  # the device's row state is rebuilt
            meta = torch.zeros(4, b, dtype=torch.long)
            meta[:, :n] = run.feeds(samples)
            self._meta[:, :b].copy_(meta)
            self._rows_moved, self._meta_rows = False, b
        # The step itself advances each row's state on the device (see _step); padding rows
        # (past n) advance too, clamped to valid indices.
        step_u = self._meta[3, :b].clamp(max=run.params.max_new_tokens - 1)
        self._u[:b] = run.uniforms[self._meta[2, :b], step_u]
        # recording routes reads the routers' hooks after each step: eager steps only
        if self.graphs is not None and run.routes is None:  # a warm-up is undone
            step = lambda: self._step(b, ctx, run.params)  # noqa: E731
            self.graphs.run((b, ctx, run.params), step, lambda: self._meta_checkpoint(b))
        else:
            self._step(b, ctx, run.params)
        if run.routes is not None:  # the rows fed (never ahead: see _loop), before compaction
            positions = run.prompt_lens[samples] + run.lengths[samples] - 1
            run.routes.rows(run.rows, positions.tolist())
        self.stats["decode_steps"] += 1
        self.stats["decode_rows"] += b
        self.stats["decode_live_rows"] += n
        host = self._host_out[self.stats["decode_steps"] % 2]
        host[:, :n].copy_(self._out[:, :n], non_blocking=True)
        event = None
        if host.is_pinned():
            event = torch.cuda.Event()
            event.record()
        return Launched(samples, host[:, :n], event, ctx)

    def _collect(self, run: Run, step: Launched, skip: list[int] = ()) -> list[int]:
        """Record a launched step's tokens (except rows ``skip``); its rows that finished."""
        if step.event is not None:
            step.event.synchronize()
        keep = torch.ones(len(step.samples), dtype=torch.bool)
        keep[list(skip)] = False
        out = step.out[:, keep]
        done = run.record(step.samples[keep], out[0].long(), out[1])
        self.stats["generated_tokens"] += int(keep.sum())
        return keep.nonzero()[:, 0][done].tolist()

    def _meta_checkpoint(self, b: int):
        """Saves rows ``0 .. b-1``'s device state; returns what restores it."""
        saved = self._meta[:, :b].clone()
        return lambda: self._meta[:, :b].copy_(saved)

    def _step(self, b: int, ctx: int, params: SamplingParams) -> None:
        """The device-only decode step over rows ``0 .. b-1`` (static inputs -> static out)."""
        ids, pos = self._meta[0, :b], self._meta[1, :b]
        self.cache.plan_decode(pos, ctx)
        with no_host_sync(self.model):  # MoE at EP > 1: the gathered dispatch (lock step)
            if self._fused is not None:
                hidden = self._fused(ids, pos, self.cache, self._rope)
            else:
                hidden = self._forward(ids[:, None], pos[:, None])[0]  # [b, H]
        tokens, logp = self._next_tokens(hidden, self._u[:b], params)
        self._out[0, :b].copy_(tokens)
        self._out[1, :b].copy_(logp)
        # The next step's inputs, without a round trip through the host.
        self._meta[0, :b].copy_(tokens)
        self._meta[1, :b].add_(1).clamp_(max=self.cache.seq_len - 1)
        self._meta[3, :b].add_(1)

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden states ``[s, b, H]`` of tokens ``ids [b, s]`` at positions
        ``pos [b, s]`` (prefill: b = 1 and the documents restart at 0; decode: s = 1).

        RoPE is applied by the cached attention from cos / sin gathered once per forward at
        each token's own position (megatron's formula): megatron's packed-sequence RoPE loops
        over documents in Python at every layer, and its per-layer cos / sin are a dozen small
        kernels per layer in every decode step."""
        emb = self.model.embedding(input_ids=ids, position_ids=pos)  # [s, b, H]
        if self._rope is not None:
            at = pos.t()  # [s, b]
            self.cache.rope = (self._rope[0][at][:, :, None], self._rope[1][at][:, :, None])
        return self.model.decoder(hidden_states=emb, attention_mask=None, rotary_pos_emb=None)

    def _retire(self, run: Run, finished: list[int], ctx: int | None = None) -> None:
        """Drop the ``finished`` rows (ascending), moving the last active rows into their
        slots (``Run.retire`` says which cache rows move where)."""
        if not finished:
            return
        self._rows_moved = True
        src, dst = run.retire(finished)
        self.cache.move_rows(src, dst, ctx or self.cache.seq_len)
