"""The per-rank memory plan, without GPUs and without a model (:mod:`.memory`)."""
