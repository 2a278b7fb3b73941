"""The model's tokenizer and chat template, loaded from a Hugging Face directory (the model's
own, or a copy fetched from an engine), behind the few calls the frontend makes."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from frontend_svc.messages import ChatMessage
from shared.errors import InvalidRequestError


class Tokenizer:
    def __init__(self, hf_tokenizer: Any) -> None:
        self.hf_tokenizer = hf_tokenizer

    @classmethod
    def load(cls, directory: Path) -> Tokenizer:
        # Imported here: transformers takes seconds to import, and only loading needs it.
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(str(directory), local_files_only=True))

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf_tokenizer, "chat_template", None))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf_tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool) -> str:
        return str(self.hf_tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens))

    def render_chat(
        self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True
    ) -> list[int]:
        """The messages through the chat template, tokenized. The template writes the special
        tokens itself, so the tokenizer adds none (a second BOS would change the output)."""
        if not self.has_chat_template:
            raise InvalidRequestError("messages", "the model has no chat template")
        conversation = [{"role": m.role, "content": m.content} for m in messages]
        try:
            text = self.hf_tokenizer.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except Exception as error:  # jinja2 errors, or a template's raise_exception()
            raise InvalidRequestError("messages", f"the chat template failed: {error}") from error
        return self.encode(str(text), add_special_tokens=False)
