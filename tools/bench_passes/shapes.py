"""Model shape presets of the benchmark (torch-free: the command line reads them)."""

from __future__ import annotations

QWEN3_0_6B = dict(layers=28, hidden=1024, ffn=3072, heads=16, kv_heads=8, head_dim=128,
                  vocab=151936, tied=True)  # fmt: skip
# --dense8b: Qwen3-8B's layer shape (36 layers there)
QWEN3_8B_LAYERS = dict(layers=4, hidden=4096, ffn=12288, heads=32, kv_heads=8, head_dim=128,
                       vocab=151936, tied=False)  # fmt: skip
TINY = dict(layers=2, hidden=64, ffn=128, heads=4, kv_heads=2, head_dim=16, vocab=512, tied=True)
# --moe: Qwen3-30B-A3B's layer shape (48 layers there), every layer MoE
QWEN3_30B_A3B = dict(layers=12, hidden=2048, ffn=6144, heads=32, kv_heads=4, head_dim=128,
                     vocab=151936, tied=False, num_experts=128, topk=8, moe_ffn=768)  # fmt: skip
TINY_MOE = dict(TINY, num_experts=8, topk=2, moe_ffn=32)
EXPERTS = ("sequential", "grouped")  # megatron-core's SequentialMLP / our GroupedExperts


def preset(tiny: bool, moe: bool, dense8b: bool) -> dict:
    """The shape the flags pick (``--dense8b`` has no tiny form: ``--tiny`` wins)."""
    shape = (TINY_MOE if tiny else QWEN3_30B_A3B) if moe else (TINY if tiny else QWEN3_0_6B)
    return QWEN3_8B_LAYERS if dense8b and not tiny and not moe else shape
