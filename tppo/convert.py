"""Round-trip a Hugging Face MoE checkpoint through the Megatron-Core model (Qwen3-MoE, Mixtral).

    python -m tppo.convert --from-hf DIR --to-hf OUT [--ep N]

Loads DIR into a Megatron GPTModel with N expert-parallel ranks (N local processes over gloo/NCCL, each
reading only its own experts) and exports it back to OUT as safetensors in logical expert order, with
the source tensors' dtypes and the source's config and tokenizer files. The work is in tppo.engine.convert.
A bad input ends with one `error:` line and exit status 2, and an output folder this call created is removed;
TPPO_DEBUG=1 shows the traceback instead.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tppo.convert", description=__doc__.splitlines()[0])
    parser.add_argument("--from-hf", required=True, help="source Hugging Face checkpoint folder")
    parser.add_argument("--to-hf", required=True, help="output folder")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel ranks (local processes)")
    parser.add_argument("--max-shard-gb", type=float, default=2.0, help="largest output shard, GiB")
    args = parser.parse_args(argv)
    from tppo.engine.convert import convert_checkpoint

    created = not Path(args.to_hf).exists()
    try:
        convert_checkpoint(
            args.from_hf, args.to_hf, ep=args.ep, max_shard_bytes=int(args.max_shard_gb * (1 << 30))
        )
    except (ValueError, KeyError, OSError, RuntimeError) as err:
        if created:
            shutil.rmtree(args.to_hf, ignore_errors=True)
        if os.environ.get("TPPO_DEBUG"):
            raise
        print(
            f"error: {str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__}",
            file=sys.stderr,
        )
        sys.exit(2)
    print(f"wrote {args.to_hf}")


if __name__ == "__main__":
    main()
