"""T-PPO with EGAE on Megatron-Core, in layers; each may import only the layers below it (checked by `make test`):

    loop/     the driver loop, a whole run (resume, summary), the ReLibra adapter, tasks, report
    config.py ExperimentConfig: composes the layers' configs (only loop/ and recipes/ import it)
    eval/     sampled evaluation (AIME avg@n, pass@k, cons@n) and the loop's periodic evaluation
    cluster/  Ray: typed role handles, the rank workers, placement, Ray start-up
    algo/     pure T-PPO: advantages, losses, objectives, the sample pool, batching, the stages of a step
    engine/   the Megatron-Core engine with its own config (no Ray, no algorithm, no relibra)
    base/     fields, registry, atomic checkpoint files, metrics logger, offload (imports nothing of ours)

relibra/ and rollout/ may import tppo.base and nothing else of tppo.
"""
