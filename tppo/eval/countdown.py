"""The countdown task of the default recipe (rollout.synthetic) as an evaluation: its problems, its verdict,
and its tokenizer in Hugging Face form, which a run of that task saves with every export so that the export
can be evaluated (`python -m recipes.eval checkpoint=runs/default data=synthetic`).

Problems: one per start n in [MIN_START, max_number), the range the training prompts are drawn from, in that
order (`limit` keeps the shortest). A sample is correct when the task's own verifier gives it full marks: the
exact countdown n-1, ..., 0 and then EOS (`rollout.synthetic.Countdown.score` = 1). Its "answer" for the
majority vote is the decoded response.

The tokenizer: a word-level vocabulary whose ids are the task's ids, numbers "0".."max_number-1" then the
specials <bos>, <eos>, <sep>, <pad>, split on whitespace (so a countdown decodes as "11 10 ... 0"); an unknown
word encodes to <pad>. Its size names the task (`task_of`): an export of a run with data.countdown_max=N carries
the tokenizer of N numbers.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from rollout import synthetic
from rollout.data import PromptRecord
from rollout.tokenizer import Tokenizer

SPECIALS = ("<bos>", "<eos>", "<sep>", "<pad>")  # in the task's order after the numbers


def save_tokenizer(folder: str | Path, task: synthetic.Countdown = synthetic.COUNTDOWN) -> None:
    """Write the countdown's tokenizer into `folder` (tokenizer.json and tokenizer_config.json, loadable by
    transformers' AutoTokenizer and rollout.tokenizer.load_tokenizer)."""
    from tokenizers import Tokenizer as WordTokenizer
    from tokenizers import models, pre_tokenizers

    specials = dict(zip(SPECIALS, (task.bos, task.eos, task.sep, task.pad), strict=True))
    vocab = {str(i): i for i in range(task.max_number)} | specials
    tok = WordTokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(
        list(specials)
    )  # already in the vocabulary: marks them special (skipped on decode)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "sep_token": "<sep>",
        "pad_token": "<pad>",
        "model_max_length": task.vocab_size,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def task_of(tokenizer: Tokenizer) -> synthetic.Countdown | None:
    """The countdown whose tokenizer this is (the one `save_tokenizer` writes for it), else None."""
    if tokenizer.vocab_size <= synthetic.MIN_START + 4:
        return None
    task = synthetic.Countdown.from_vocab_size(tokenizer.vocab_size)
    if tokenizer.eos_token_id != task.eos:
        return None
    if tokenizer.encode("<bos> 3 <sep> 0 <eos>") != [*task.prompt_ids(3), 0, task.eos]:
        return None
    return task


def records(tokenizer: Tokenizer, task: synthetic.Countdown) -> list[PromptRecord]:
    """One problem per start n (module docstring); the reference is the correct countdown as the tokenizer
    decodes it."""
    out = []
    for n in range(synthetic.MIN_START, task.max_number):
        reference = tokenizer.decode(task.reference_response(n), skip_special_tokens=True)
        out.append(
            PromptRecord(
                id=f"countdown-{n}",
                problem=f"count down from {n}",
                answer=reference,
                prompt_token_ids=task.prompt_ids(n),
                source=f"synthetic:countdown:{n}",
            )
        )
    return out


def correct(task: synthetic.Countdown, prompt_ids: Sequence[int], response_ids: Sequence[int]) -> bool:
    """Full marks from the task's verifier: the exact countdown, then EOS."""
    return task.score(list(prompt_ids), list(response_ids)) >= 1.0
