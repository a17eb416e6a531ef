"""The GRPO step for Megatron's schedules (:mod:`.forward`), its log-prob paths
(:mod:`.logprob_paths`) and Megatron's own output-layer path, the baseline (:mod:`.baseline`)."""
