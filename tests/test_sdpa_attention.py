"""SDPAttention on unpacked [s, b, n, d] inputs: the query may be shorter than the keys (a
KV-cached decode step through megatron-core's inference plumbing), masks align bottom-right,
``no_mask`` and key-padding masks are honoured, GQA groups query heads per KV head."""

from __future__ import annotations

import math

import pytest
import torch
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_grpo.megatron.attention.sdpa import SDPAttention


def _attention(mask_type=AttnMaskType.causal) -> SDPAttention:
    cfg = TransformerConfig(
        num_layers=1,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=16,
        attention_dropout=0.0,
    )
    return SDPAttention(cfg, 1, mask_type, "self").eval()


def _reference(q, k, v, allowed):
    """float64 softmax attention; ``allowed [b, s_q, s_k]``; GQA by repeating K/V heads."""
    g = q.size(2) // k.size(2)
    k, v = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)
    scores = torch.einsum("qbnd,kbnd->bnqk", q.double(), k.double()) / math.sqrt(q.size(-1))
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    out = torch.einsum("bnqk,kbnd->qbnd", scores.softmax(-1), v.double())
    return out.reshape(q.size(0), q.size(1), -1).float()


def _qkv(s_q, s_k, b=3):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(s_q, b, 4, 16, generator=g)
    k, v = (torch.randn(s_k, b, 2, 16, generator=g) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("s_q", [1, 3])
def test_causal_query_shorter_than_keys_aligns_bottom_right(s_q):
    """Query i of s_q sees keys <= i + s_k - s_q: a one-token decode query sees all keys (torch's
    is_causal aligns top-left and would show it key 0 only)."""
    q, k, v = _qkv(s_q, 7)
    allowed = torch.arange(7)[None, :] <= torch.arange(s_q)[:, None] + 7 - s_q
    out = _attention()(q, k, v, None)
    torch.testing.assert_close(out, _reference(q, k, v, allowed.expand(3, -1, -1)))


def test_no_mask_and_key_padding():
    q, k, v = _qkv(1, 6)
    att = _attention()
    full = torch.ones(3, 1, 6, dtype=torch.bool)
    out = att(q, k, v, None, attn_mask_type=AttnMaskType.no_mask)
    torch.testing.assert_close(out, _reference(q, k, v, full))
    # megatron's convention: True = masked out; row r sees its first 2 + 2r keys only
    lengths = torch.tensor([2, 4, 6])
    padding = torch.arange(6)[None, :] >= lengths[:, None]
    out = att(q, k, v, padding[:, None, None, :], attn_mask_type=AttnMaskType.no_mask)
    torch.testing.assert_close(out, _reference(q, k, v, ~padding[:, None, :]))
    # padding combined with a (bottom-right) causal mask
    q3 = _qkv(3, 6)[0]
    causal = torch.arange(6)[None, :] <= torch.arange(3)[:, None] + 3
    out = att(q3, k, v, padding[:, None, None, :], attn_mask_type=AttnMaskType.padding_causal)
    torch.testing.assert_close(out, _reference(q3, k, v, causal[None] & ~padding[:, None, :]))


def test_equal_lengths_stay_plain_causal():
    q, k, v = _qkv(5, 5)
    allowed = torch.ones(5, 5, dtype=torch.bool).tril()
    torch.testing.assert_close(_attention()(q, k, v, None), _reference(q, k, v, allowed[None]))
