"""The vocab-parallel LM-head op: log-probs and the fused GRPO loss from hidden states and a
vocabulary shard, run by one plan per call (:mod:`.plan`) over the kernel seam (:mod:`.seam`)."""
