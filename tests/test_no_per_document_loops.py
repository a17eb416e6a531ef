"""The per-micro-batch code of the training passes has no loop over the documents (issue 22).

For each vectorized function: (a) equality with a straightforward per-document reference on
random layouts (one document, many, empty documents where legal, one-token documents, CP sizes
1 / 2 / 4), and (b) the number of torch ops it dispatches is the same for 4 and for 64 documents,
so a per-document loop (torch ops inside it) cannot come back unnoticed.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_grpo.loss.segments import check_cu_seqlens
from megatron_grpo.megatron.attention import cp as cpa
from megatron_grpo.megatron.batch.packing import (
    PackedBatch,
    pack_sequences,
    padded_layout,
    split_for_context_parallel,
    thd_partition_index,
)
from tests.op_count import CountOps


def _ops(fn, *args, **kwargs) -> int:
    with CountOps() as mode:
        fn(*args, **kwargs)
    return mode.count


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _lengths(n: int, low: int, high: int, seed: int) -> list[int]:
    return torch.randint(low, high + 1, (n,), generator=_gen(seed)).tolist()


def _cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens, dtype=torch.long).cumsum(0).tolist()])


# ---------------------------------------------------------------------------------------------
# thd_partition_index


def _ref_partition(cu: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    bounds = cu.tolist()
    parts = []
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        if (end - start) % (2 * cp_size):
            raise ValueError(f"padded sequence length {end - start} not divisible by 2*CP")
        chunk = (end - start) // (2 * cp_size)
        for c in (cp_rank, 2 * cp_size - 1 - cp_rank):
            parts.append(torch.arange(start + c * chunk, start + (c + 1) * chunk))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def _padded_layouts(cp: int):
    step = 2 * cp
    yield [step]  # one document of one chunk per rank
    yield [7 * step]  # one document
    yield [0]  # one empty document
    yield [step, 0, 3 * step, 0, 0, step]  # empty documents between
    yield [step * n for n in _lengths(64, 0, 9, seed=cp)]  # many, some empty
    yield [step * n for n in _lengths(200, 1, 40, seed=10 + cp)]


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_thd_partition_index_matches_per_document_reference(cp):
    for padded in _padded_layouts(cp):
        cu = _cu(padded).to(torch.int32)
        got = [thd_partition_index(cu, cp, r) for r in range(cp)]
        for r in range(cp):
            want = _ref_partition(cu, cp, r)
            assert got[r].dtype == torch.long and torch.equal(got[r], want), (padded, r)
        # the ranks' shares tile the padded batch exactly once
        assert torch.equal(torch.cat(got).sort().values, torch.arange(int(cu[-1])))


def test_thd_partition_index_empty_and_errors():
    assert torch.equal(thd_partition_index(torch.zeros(1, dtype=torch.int32), 2, 1), _cu([])[:0])
    with pytest.raises(ValueError, match="padded sequence length 6 not divisible by 2\\*CP"):
        thd_partition_index(_cu([8, 6, 5]), 2, 0)  # the first offending document is named
    with pytest.raises(ValueError, match="padded sequence length 3 not divisible by 2\\*CP"):
        thd_partition_index(_cu([3]), 1, 0)


def test_thd_partition_index_op_count_does_not_grow():
    few, many = (_cu([4 * n for n in _lengths(s, 1, 9, seed=s)]) for s in (4, 64))
    assert _ops(thd_partition_index, few, 2, 1) == _ops(thd_partition_index, many, 2, 1)


# ---------------------------------------------------------------------------------------------
# pack_sequences


def _ref_pack(seqs, masks, logprobs, advantages, routes, pad_to):
    toks, targets, loss_mask, pos, lens, lp = [], [], [], [], [], []
    for seq, m, v in zip(seqs, masks, logprobs, strict=True):
        toks.append(seq.long())
        targets.append(torch.cat([seq[1:].long(), torch.zeros(1, dtype=torch.long)]))
        loss_mask.append(torch.cat([m[1:].bool(), torch.zeros(1, dtype=torch.bool)]))
        pos.append(torch.arange(seq.numel()))
        lp.append(torch.cat([v[1:].float(), torch.zeros(1)]))
        lens.append(seq.numel())
    pad = -sum(lens) % pad_to
    adv = [torch.full((n,), float(a)) for n, a in zip(lens, advantages, strict=True)]
    rts = [r.long() for r in routes]
    if pad:
        for parts in (toks, targets, pos):
            parts.append(torch.arange(pad) if parts is pos else torch.zeros(pad, dtype=torch.long))
        loss_mask.append(torch.zeros(pad, dtype=torch.bool))
        lp.append(torch.zeros(pad))
        adv.append(torch.zeros(pad))
        rts.append(torch.full((pad, *routes[0].shape[1:]), -1, dtype=torch.long))
        lens.append(pad)
    return {
        "tokens": torch.cat(toks),
        "position_ids": torch.cat(pos),
        "targets": torch.cat(targets),
        "loss_mask": torch.cat(loss_mask),
        "cu_seqlens": _cu(lens).to(torch.int32),
        "advantages": torch.cat(adv),
        "old_logprobs": torch.cat(lp),
        "routes": torch.cat(rts),
    }


def _samples(lens: list[int], seed: int, token_dtype=torch.long):
    g = _gen(seed)
    seqs = [torch.randint(1, 1000, (n,), generator=g).to(token_dtype) for n in lens]
    masks = [torch.rand(n, generator=g) > 0.3 for n in lens]
    logprobs = [-torch.rand(n, generator=g, dtype=torch.float64) for n in lens]
    advantages = torch.randn(len(lens), generator=g).tolist()
    routes = [torch.randint(-1, 8, (n, 3, 2), generator=g, dtype=torch.int32) for n in lens]
    return seqs, masks, logprobs, advantages, routes


@pytest.mark.parametrize(
    "lens",
    [[1], [9], [1, 1, 1], [5, 1, 17, 3, 1, 64], _lengths(64, 1, 50, seed=3)],
)
@pytest.mark.parametrize("pad_to", [1, 4, 8])
def test_pack_sequences_matches_per_sequence_reference(lens, pad_to):
    seqs, masks, lps, adv, routes = _samples(lens, seed=len(lens) + pad_to)
    got = pack_sequences(
        seqs, masks, advantages=adv, old_logprobs=lps, routes=routes, pad_to_multiple_of=pad_to
    )
    got.validate()
    want = _ref_pack(seqs, masks, lps, adv, routes, pad_to)
    for name, x in want.items():
        y = getattr(got, name)
        assert y.dtype == x.dtype and torch.equal(y, x), name
    # the inputs are not aliased (one cat copies even a single sequence)
    got.tokens[0] = -5
    assert seqs[0][0] != -5


def test_pack_sequences_converts_dtypes_like_the_reference():
    lens = [3, 1, 4]
    seqs, masks, lps, adv, routes = _samples(lens, seed=0, token_dtype=torch.int32)
    masks = [m.to(torch.uint8) for m in masks]
    lps = [v.to(torch.bfloat16) for v in lps]
    got = pack_sequences(seqs, masks, advantages=adv, old_logprobs=lps, routes=routes)
    want = _ref_pack(seqs, masks, lps, adv, routes, 1)
    for name, x in want.items():
        assert torch.equal(getattr(got, name), x), name
    # mixed dtypes: each part is converted on its own (no promotion through a common dtype)
    seqs[1] = seqs[1].long()
    lps = [lps[0].double(), lps[1].half(), lps[2].float()]
    routes[0] = routes[0].long()
    got = pack_sequences(seqs, masks, advantages=adv, old_logprobs=lps, routes=routes)
    want = _ref_pack(seqs, masks, lps, adv, routes, 1)
    for name, x in want.items():
        assert torch.equal(getattr(got, name), x), name


def test_pack_sequences_errors_name_the_sequence():
    seqs, masks, lps, _, routes = _samples([3, 4], seed=0)
    with pytest.raises(ValueError, match="sequence 1: tokens and response mask"):
        pack_sequences(seqs, [masks[0], masks[1][:2]])
    with pytest.raises(ValueError, match=r"old_logprobs\[1\] must have shape \[4\], got \[3\]"):
        pack_sequences(seqs, masks, old_logprobs=[lps[0], lps[0]])
    with pytest.raises(ValueError, match="ref_logprobs must have one tensor per sequence"):
        pack_sequences(seqs, masks, ref_logprobs=lps[:1])


def test_pack_sequences_op_count_does_not_grow():
    def run(n):
        lens = _lengths(n, 1, 30, seed=n)
        seqs, masks, lps, adv, routes = _samples(lens, seed=n)  # float64 lps, int32 routes
        return _ops(
            pack_sequences, seqs, masks, advantages=adv, old_logprobs=lps,
            rollout_logprobs=lps, routes=routes, pad_to_multiple_of=8,
        )  # fmt: skip

    assert run(4) == run(64)


# ---------------------------------------------------------------------------------------------
# padded_layout / split_for_context_parallel


def _batch(lens: list[int], seed: int, with_routes: bool = True) -> PackedBatch:
    seqs, masks, lps, adv, routes = _samples(lens, seed=seed)
    return pack_sequences(
        seqs, masks, advantages=adv, old_logprobs=lps, routes=routes if with_routes else None
    )


def _ref_split(batch: PackedBatch, cp: int, rank: int, multiple: int):
    """Per document: pad it, then keep chunks rank and 2 cp - 1 - rank of it."""
    step = 2 * cp * multiple
    bounds = batch.cu_seqlens.tolist()
    fields = {}
    cu_pad = [0]
    for name in ("tokens", "targets", "loss_mask", "advantages", "old_logprobs", "routes"):
        fields[name] = []
    fields["position_ids"] = []
    for s, e in zip(bounds[:-1], bounds[1:], strict=True):
        n = e - s
        padded = -(-n // step) * step
        cu_pad.append(cu_pad[-1] + padded)
        chunk = padded // (2 * cp)
        keep = [*range(rank * chunk, (rank + 1) * chunk)]
        keep += [*range((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk)]
        for name, parts in fields.items():
            if name == "position_ids":
                parts.append(torch.arange(padded)[keep])
                continue
            x = getattr(batch, name)[s:e]
            full = x.new_full((padded, *x.shape[1:]), -1 if name == "routes" else 0)
            full[:n] = x
            parts.append(full[keep])
    local = {k: torch.cat(v) for k, v in fields.items()}
    return local, torch.tensor(cu_pad)


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("multiple", [1, 2])
@pytest.mark.parametrize(
    "lens", [[1], [13], [1, 1, 2, 1], [5, 1, 17, 3, 64, 9], _lengths(64, 1, 40, seed=5)]
)
def test_split_for_context_parallel_matches_per_document_reference(cp, multiple, lens):
    batch = _batch(lens, seed=cp)
    for rank in range(cp):
        local, params, index = split_for_context_parallel(batch, cp, rank, multiple)
        want, cu_pad = _ref_split(batch, cp, rank, multiple)
        for name, x in want.items():
            y = getattr(local, name)
            assert y.dtype == x.dtype and torch.equal(y, x), (name, rank)
        assert torch.equal(local.cu_seqlens, (cu_pad // cp).to(torch.int32))
        assert torch.equal(params.cu_seqlens_q_padded, cu_pad.to(torch.int32))
        assert torch.equal(params.cu_seqlens_q, batch.cu_seqlens.to(torch.int32))
        assert params.max_seqlen_q == int((cu_pad[1:] - cu_pad[:-1]).max())
        assert torch.equal(index, _ref_partition(cu_pad, cp, rank))
        cu_pad2, dest = padded_layout(batch, cp, multiple)
        assert torch.equal(cu_pad2.long(), cu_pad)
        ends = cu_pad[:-1].repeat_interleave(torch.tensor(lens))
        starts = batch.cu_seqlens[:-1].long().repeat_interleave(torch.tensor(lens))
        assert torch.equal(dest, torch.arange(batch.num_tokens) - starts + ends)


def test_split_for_context_parallel_op_count_does_not_grow():
    few, many = (_batch(_lengths(s, 1, 40, seed=s), seed=s) for s in (4, 64))
    assert _ops(split_for_context_parallel, few, 2, 1, 2) == _ops(
        split_for_context_parallel, many, 2, 1, 2
    )
    assert _ops(padded_layout, few, 4) == _ops(padded_layout, many, 4)


# ---------------------------------------------------------------------------------------------
# check_cu_seqlens (the host check of every micro-batch's loss)


def test_check_cu_seqlens_messages_and_op_count():
    check_cu_seqlens(_cu([3, 0, 5]), 8)
    check_cu_seqlens(torch.zeros(1, dtype=torch.int32), 0)
    with pytest.raises(ValueError, match="must start at 0, got 1"):
        check_cu_seqlens(torch.tensor([1, 3]), 3)
    with pytest.raises(ValueError, match=r"non-decreasing, got \[0, 4, 2, 6\]"):
        check_cu_seqlens(torch.tensor([0, 4, 2, 6]), 6)
    with pytest.raises(ValueError, match="must end at T=7, got 6"):
        check_cu_seqlens(torch.tensor([0, 4, 6], dtype=torch.int32), 7)
    few, many = (_cu(_lengths(s, 0, 30, seed=s)) for s in (4, 64))
    assert _ops(check_cu_seqlens, few, int(few[-1])) == _ops(check_cu_seqlens, many, int(many[-1]))


# ---------------------------------------------------------------------------------------------
# context-parallel attention: layout (host, once per micro-batch) and the per-layer SDPA calls


def _sdpa(q, k, v, mask):
    """The caller's SDPA: GQA by repeat_interleave (as SDPAttention's fallback)."""
    groups = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _cp_reference(q, k, v, bounds: list[int]) -> torch.Tensor:
    """One causal SDPA per document of the unsplit padded batch."""
    out = torch.zeros_like(q)
    for s, e in zip(bounds[:-1], bounds[1:], strict=True):
        if e > s:
            x = [t[s:e].transpose(0, 1)[None] for t in (q, k, v)]
            groups = q.size(1) // k.size(1)
            x[1], x[2] = (t.repeat_interleave(groups, dim=1) for t in x[1:])
            out[s:e] = F.scaled_dot_product_attention(*x, is_causal=True)[0].transpose(0, 1)
    return out


def _cp_case(padded: list[int], cp: int, exact_min_chunk: int, seed: int = 0):
    """Every rank's _attend (on K/V gathered in rank-major order, as the all-gather gives them)
    against the per-document reference; float64 leaves, gradients too."""
    bounds = _cu(padded).tolist()
    total = bounds[-1]
    g = _gen(seed)
    q, k, v = (
        torch.randn(total, n, 8, generator=g, dtype=torch.float64).requires_grad_()
        for n in (4, 2, 2)
    )
    want = _cp_reference(q, k, v, bounds)
    grad = torch.randn(want.shape, generator=g, dtype=torch.float64)
    want_grads = torch.autograd.grad(want, (q, k, v), grad)
    index = [_ref_partition(torch.tensor(bounds), cp, r) for r in range(cp)]
    got_grads = [torch.zeros_like(x) for x in (q, k, v)]
    calls = 0
    for rank in range(cp):
        kg, vg = (torch.cat([x[i] for i in index]) for x in (k, v))  # the all-gather's order
        groups = cpa._layout(bounds, cp, rank, total // cp, "cpu", exact_min_chunk)
        calls += sum(len(grp.queries) for grp in groups)
        out = cpa._attend(q[index[rank]], kg, vg, groups, _sdpa)
        torch.testing.assert_close(out, want[index[rank]], rtol=1e-10, atol=1e-10)
        grads = torch.autograd.grad(out, (q, k, v), grad[index[rank]])
        for acc, d in zip(got_grads, grads, strict=True):
            acc += d
    for a, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, w, rtol=1e-10, atol=1e-10)
    return calls


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("exact_min_chunk", [1, 4, 1 << 30])  # all exact, mixed, all bucketed
def test_cp_attention_matches_per_document_reference(cp, exact_min_chunk):
    step = 2 * cp
    layouts = [
        [step],  # one document of one token per chunk
        [9 * step],
        [step, 0, 3 * step, 0, step],  # empty documents
        [step * n for n in [1, 2, 3, 5, 7, 8, 6, 4, 1, 1]],  # several lengths per bucket
        [step * n for n in _lengths(24, 0, 12, seed=cp)],
    ]
    for padded in layouts:
        _cp_case(padded, cp, exact_min_chunk, seed=len(padded))


def test_cp_layout_groups_are_exact_for_long_documents_and_bucketed_for_short():
    cp, step = 2, 4
    chunks = [300, 300, 301, 5, 6, 7, 8, 9, 1, 2]
    groups = cpa._layout(_cu([step * c for c in chunks]).tolist(), cp, 1, sum(chunks) * 2, "cpu")
    got = sorted((g.chunk, g.key_index.shape[0], g.queries[0].mask is None) for g in groups)
    # long: one group per exact length (no mask); short: ceil(log2(chunk)) buckets, padded
    want = [(1, 1, True), (2, 1, True), (8, 4, False), (9, 1, True), (300, 2, True)]
    want += [(301, 1, True)]
    assert got == want


def test_cp_layout_errors():
    with pytest.raises(ValueError, match="a document of 6 padded tokens is not a multiple of 2"):
        cpa._layout([0, 8, 14, 22], 2, 0, 11, "cpu")
    with pytest.raises(ValueError, match="the padded documents hold 8 tokens"):
        cpa._layout([0, 8], 2, 0, 3, "cpu")


def test_cp_attention_calls_and_layout_ops_do_not_grow():
    """Short documents of many different lengths: the SDPA calls per layer and the layout's torch
    ops are the same for 4 and for 64 documents (one power-of-two bucket: chunks 5 .. 8)."""
    cp, step = 2, 4
    few = [step * c for c in (5, 6, 7, 8)]
    many = [step * c for c in _lengths(60, 5, 8, seed=1)] + few
    counts = [_cp_case(p, cp, cpa._EXACT_MIN_CHUNK) for p in (few, many)]
    assert counts[0] == counts[1] == 2 * cp  # two query chunks per rank, one group

    def layout_ops(padded):
        bounds = _cu(padded).tolist()
        return _ops(cpa._layout, bounds, cp, 0, bounds[-1] // cp, "cpu")

    assert layout_ops(few) == layout_ops(many)
