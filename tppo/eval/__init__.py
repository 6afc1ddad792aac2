"""Sampled evaluation of a policy on a math benchmark: avg@n, unbiased pass@k, cons@n, lengths, per-problem
tables, and the periodic evaluation the training loop runs with the rollout engines it holds."""
