"""Mixture of experts: grouped experts (:mod:`.grouped_experts`) and their checkpoint format
(:mod:`.expert_checkpoint`), the dispatchers' token permutation (:mod:`.permute`), routing replay
(:mod:`.routing_replay`) and the router's aux losses as metrics (:mod:`.metrics`)."""
