"""Triton kernels of the rollout engine beyond attention.

`rollout.kernels.persistent_moe`: the persistent, tile-scheduled MoE expert MLP (ExpertPlex): decode tiles
first, prefill tiles preemptible between tiles, resumable, with an exact torch reference."""
