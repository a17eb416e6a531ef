"""Attention of packed (THD) micro-batches: causal attention over packed documents
(:mod:`.packed`), their RoPE (:mod:`.rope`) and context-parallel attention (:mod:`.cp`)."""
