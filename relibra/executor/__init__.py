"""ReLibra's executor: applies a `relibra.plan.Plan` to the Megatron-Core MoE layers of an engine.

- `relibra.executor.engine_api`: the `ExpertEngine` Protocol, what the executor needs from the engine (relibra
  never imports the trainer);
- `relibra.executor.tables`: pure NumPy tables derived from a plan (reroute tables, replica exchanges,
  migration moves) and the executor-side plan check;
- `relibra.executor.reroute`: logical -> physical routing (gate probabilities keep their gradient);
- `relibra.executor.comm`: point-to-point replica push with the gradient fold in its backward, slot moves;
- `relibra.executor.executor`: `ExpertExecutor`, which hooks the above into an engine.

The package import stays light; import the submodules you need.
"""
