"""Tokenizer, chat template and incremental detokenization for a checkpoint directory."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer


class Tokenizer:
    def __init__(self, path: Path):
        file = path / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(f"{path} has no tokenizer.json")
        config_file = path / "tokenizer_config.json"
        try:
            self._tok = HFTokenizer.from_file(str(file))
        except Exception as exc:  # the tokenizers library raises a bare Exception
            raise ValueError(f"cannot read {file}: {exc}") from None
        try:
            self.config: dict[str, Any] = (
                json.loads(config_file.read_text()) if config_file.is_file() else {}
            )
        except ValueError as exc:
            raise ValueError(f"cannot read {config_file} as JSON: {exc}") from None
        self.chat_template: str | None = self.config.get("chat_template")
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token = _token_text(self.config.get("eos_token"))
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        gen = path / "generation_config.json"
        extra_eos = json.loads(gen.read_text()).get("eos_token_id") if gen.is_file() else None
        ids = extra_eos if isinstance(extra_eos, list) else [extra_eos]
        self.stop_token_ids = sorted({i for i in [self.eos_token_id, *ids] if i is not None})

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def encode_releasing_gil(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``encode`` for a worker thread: the batch call releases the GIL while it splits the
        text (``encode`` holds it), so an event loop on another thread keeps running."""
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    @functools.cached_property
    def max_chars_per_token(self) -> int | None:
        """The most characters one token can stand for, where that bound is certain: a
        byte-level BPE with no normalizer, no pre-tokenizer that drops text and no added token
        that swallows whitespace. Then a text of c characters has at least c / this many
        tokens. None where text could vanish in tokenization (so no bound holds)."""
        spec = json.loads(self._tok.to_str())
        if spec.get("normalizer") is not None:
            return None
        pre = spec.get("pre_tokenizer") or {}
        parts = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
        for part in parts:
            kind = part.get("type")
            if kind == "Split" and part.get("behavior") != "Removed":
                continue
            if kind != "ByteLevel":
                return None
        if not any(part.get("type") == "ByteLevel" for part in parts):
            return None
        added = spec.get("added_tokens", [])
        if any(t.get("lstrip") or t.get("rstrip") for t in added):
            return None
        # Byte-level vocabulary entries spell one character per byte, and a text never has
        # more characters than bytes; added tokens match their content literally.
        vocab = self._tok.get_vocab(with_added_tokens=True)
        return max((len(piece) for piece in vocab), default=None)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        if not self.chat_template:
            raise ValueError("this model's tokenizer_config.json has no chat_template")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(message: str) -> None:
            raise jinja2.TemplateError(message)

        env.globals["raise_exception"] = raise_exception
        template = env.from_string(self.chat_template)
        return template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "<|endoftext|>", ...}
        return value.get("content")
    return value


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without re-decoding everything.

    Byte-level BPE tokens can end mid-way through a UTF-8 character; text is only released once
    it no longer ends in the replacement character, and a small window of earlier tokens is
    re-decoded so merges across token boundaries come out right.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int]):
        self.tokenizer = tokenizer
        self.ids: list[int] = list(prompt_ids[-8:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        # Start the window on a character boundary: a window that begins mid-character would
        # decode to replacement marks that the trailing-partial rule below cannot tell apart.
        while self.prefix_offset < self.read_offset and tokenizer.decode(
            self.ids[self.prefix_offset : self.read_offset]
        ).startswith("\ufffd"):
            self.prefix_offset += 1
        # Text released so far ends cleanly, except possibly the prompt's: when it ends part-way
        # through a UTF-8 character, the first output tokens complete that character, and its
        # replacement marks must not count as text already seen.
        self.at_start = True

    def flush(self) -> str:
        """Whatever is still held back (text ending mid-character) when the request ends."""
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        if self.at_start:
            prefix = prefix.rstrip("\ufffd")
        full = self.tokenizer.decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix) :]

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset : self.read_offset])
        if self.at_start:
            prefix = prefix.rstrip("\ufffd")
        full = decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            self.at_start = False
            return delta
        return ""
