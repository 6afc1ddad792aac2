"""Pure T-PPO (specs/tppo.md): advantage estimators (EGAE, GAE, GRPO), losses and the objectives the trainer
ranks run, the sample pool of successive batching, the layout of trainer micro-batches, and the stages of a step.
No Ray, no Megatron, no rollout engine, no relibra: functions of tensors, arrays and typed records."""
