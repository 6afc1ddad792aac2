"""The countdown task of the default recipe (rollout.synthetic) as an evaluation: its problems, its verdict,
and its tokenizer in Hugging Face form, which a run of that task saves with every export so that the export
can be evaluated (`python -m recipes.eval checkpoint=runs/default data=synthetic`).

Problems: one per start n in [MIN_START, MAX_NUMBER], the range the training prompts are drawn from, in that
order (`limit` keeps the shortest). A sample is correct when the task's own verifier gives it full marks: the
exact countdown n-1, ..., 0 and then EOS (`rollout.synthetic.score` = 1). Its "answer" for the majority vote
is the decoded response.

The tokenizer: a word-level vocabulary whose ids are the task's ids, numbers "0".."59" then the specials
<bos>, <eos>, <sep>, <pad>, split on whitespace (so a countdown decodes as "11 10 ... 0"); an unknown word
encodes to <pad>.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from rollout import synthetic
from rollout.data import PromptRecord
from rollout.tokenizer import Tokenizer

MIN_START = 4  # rollout.synthetic.sample_starts' default lower end
MAX_RESPONSE_TOKENS = synthetic.MAX_NUMBER + 1  # the longest correct response: 59 .. 0 and EOS
SPECIALS = {"<bos>": synthetic.BOS, "<eos>": synthetic.EOS, "<sep>": synthetic.SEP, "<pad>": synthetic.PAD}


def save_tokenizer(folder: str | Path) -> None:
    """Write the countdown's tokenizer into `folder` (tokenizer.json and tokenizer_config.json, loadable by
    transformers' AutoTokenizer and rollout.tokenizer.load_tokenizer)."""
    from tokenizers import Tokenizer as WordTokenizer
    from tokenizers import models, pre_tokenizers

    vocab = {str(i): i for i in range(synthetic.MAX_NUMBER)} | SPECIALS
    tok = WordTokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(
        list(SPECIALS)
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
        "model_max_length": synthetic.MAX_NUMBER + 4,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def is_countdown_tokenizer(tokenizer: Tokenizer) -> bool:
    """The tokenizer maps the countdown's words to the task's ids (the one `save_tokenizer` writes)."""
    if tokenizer.vocab_size != synthetic.VOCAB_SIZE or tokenizer.eos_token_id != synthetic.EOS:
        return False
    return tokenizer.encode("<bos> 12 <sep> 0 <eos>") == [*synthetic.prompt_ids(12), 0, synthetic.EOS]


def records(tokenizer: Tokenizer) -> list[PromptRecord]:
    """One problem per start n (module docstring); the reference is the correct countdown as the tokenizer
    decodes it."""
    out = []
    for n in range(MIN_START, synthetic.MAX_NUMBER + 1):
        reference = tokenizer.decode(synthetic.reference_response(n), skip_special_tokens=True)
        out.append(
            PromptRecord(
                id=f"countdown-{n}",
                problem=f"count down from {n}",
                answer=reference,
                prompt_token_ids=synthetic.prompt_ids(n),
                source=f"synthetic:countdown:{n}",
            )
        )
    return out


def correct(prompt_ids: Sequence[int], response_ids: Sequence[int]) -> bool:
    """Full marks from the task's verifier: the exact countdown, then EOS."""
    return synthetic.score(list(prompt_ids), list(response_ids)) >= 1.0
