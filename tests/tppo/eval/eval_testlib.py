"""Helpers of the evaluation tests: tiny random Qwen3-MoE checkpoints saved by transformers, and an oracle
generation backend that knows the answers."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

AIME_DIR = Path(__file__).resolve().parents[3] / ".." / "shared" / "data" / "aime"
QWEN_VOCAB = 151936  # Qwen2.5/Qwen3 embedding rows (the tokenizer has 151851 ids; the rest is padding)
IM_END, ENDOFTEXT = 151645, 151643


def save_tiny_qwen3_moe(path: Path, vocab_size: int, eos_token_id: int | None, seed: int = 0) -> Path:
    """A tiny random Qwen3-MoE saved with save_pretrained (a real HF checkpoint: config.json + safetensors)."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        eos_token_id=eos_token_id,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    Qwen3MoeForCausalLM(config).float().save_pretrained(path)
    return path


@dataclass
class Out:
    token_ids: list[int]
    finish_reason: str


class Oracle:
    """A generation backend with RolloutEngine.generate's interface that knows the answers: the j-th request for
    the prompt of records[i] returns `respond(i, answer, j)` (a text, or None for a response cut by the token
    limit)."""

    def __init__(
        self,
        tokenizer,
        records: Sequence,
        respond: Callable[[int, str, int], str | None],
        max_new_tokens: int = 64,
    ) -> None:
        self.tokenizer = tokenizer
        self.problem = {tuple(r.prompt_token_ids): (i, r.answer) for i, r in enumerate(records)}
        self.respond = respond
        self.max_new_tokens = max_new_tokens
        self.seen: Counter = Counter()
        self.num_calls = 0
        self.params: list = []

    def generate(self, prompt_token_ids, params):
        self.num_calls += 1
        self.params += list(params)
        outs = []
        for prompt in prompt_token_ids:
            key = tuple(prompt)
            text = self.respond(*self.problem[key], self.seen[key])
            self.seen[key] += 1
            if text is None:  # rambles until the limit, no final answer
                ids = self.tokenizer.encode("Let me think about this " * 20)[: self.max_new_tokens]
                outs.append(Out(ids, "length"))
            else:
                outs.append(Out([*self.tokenizer.encode(text), self.tokenizer.eos_token_id], "eos"))
        return outs


def right(_i: int, answer: str, _j: int) -> str:
    return f"Adding the cases gives the total. The final answer is $\\boxed{{{answer}}}$."


def wrong(_i: int, answer: str, _j: int) -> str:
    return f"Adding the cases gives the total. The final answer is $\\boxed{{{int(answer) + 1}}}$."
