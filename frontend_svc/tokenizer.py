"""The model's tokenizer and chat template, loaded from a Hugging Face directory (the model's
own, or a copy fetched from an engine), behind the few calls the frontend makes.

It reads what `transformers` reads (tokenizer.json, tokenizer_config.json, the chat template)
and does what its tokenizers-backed class (TokenizersBackend) does, with the `tokenizers`
library and a sandboxed jinja2 environment like its own: loading transformers imports torch
(1.5 s, and a CPU pod of the frontend has no use for it). Special tokens are added as
tokenizer.json's post-processor says (transformers does not apply a config's add_bos_token to
that class either). tests/frontend_svc/test_tokenizer.py holds the two to the same token ids,
text and rendered chats.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as BackendTokenizer

from frontend_svc.chat_template import ChatTemplate
from frontend_svc.messages import ChatMessage
from shared.errors import InvalidRequestError

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


class Tokenizer:
    def __init__(
        self,
        backend: BackendTokenizer,
        special_tokens: dict[str, str],
        chat_template: ChatTemplate | None,
        clean_up_tokenization_spaces: bool = False,
    ) -> None:
        self.backend = backend
        self.special_tokens = special_tokens  # bos_token, eos_token, ... as the template sees them
        self.chat_template = chat_template
        # transformers skips the clean-up for BPE models: it would strip real spaces. Decided
        # once here, not at every decode (the streaming detokenizer decodes every token).
        is_bpe = type(backend.model).__name__ == "BPE"
        self._clean_up_decoded = clean_up_tokenization_spaces and not is_bpe
        # The ids decode(..., skip_special_tokens=True) leaves out: added tokens marked special.
        self.special_token_ids = frozenset(
            token_id
            for token_id, token in backend.get_added_tokens_decoder().items()
            if token.special
        )

    @classmethod
    def load(cls, directory: Path) -> Tokenizer:
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {directory}")
        backend = BackendTokenizer.from_file(str(path))
        config = _read_json(directory / "tokenizer_config.json")
        special = {
            name: value
            for name in SPECIAL_TOKEN_NAMES
            if (value := _token_content(config.get(name))) is not None
        }
        template = _chat_template_source(directory, config)
        return cls(
            backend,
            special,
            ChatTemplate(template) if template else None,
            bool(config.get("clean_up_tokenization_spaces", False)),
        )

    @property
    def vocab_size(self) -> int:
        """Every id the tokenizer knows, added tokens included."""
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    @property
    def has_chat_template(self) -> bool:
        return self.chat_template is not None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool) -> str:
        text = str(self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens))
        if self._clean_up_decoded:
            text = _clean_up_tokenization(text)
        return text

    def render_chat(
        self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True
    ) -> list[int]:
        """The messages through the chat template, tokenized. The template writes the special
        tokens itself, so the tokenizer adds none (a second BOS would change the output)."""
        if self.chat_template is None:
            raise InvalidRequestError("messages", "the model has no chat template")
        conversation = [{"role": m.role, "content": m.content} for m in messages]
        try:
            text = self.chat_template.render(
                conversation, add_generation_prompt=add_generation_prompt, **self.special_tokens
            )
        except Exception as error:  # jinja2 errors, or a template's raise_exception()
            raise InvalidRequestError("messages", f"the chat template failed: {error}") from error
        return self.encode(text, add_special_tokens=False)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template_source(directory: Path, config: dict[str, Any]) -> str | None:
    """Where transformers finds it: chat_template.jinja, chat_template.json, or the config
    (a string, or a list of named templates of which "default" is used)."""
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = _read_json(directory / "chat_template.json").get("chat_template")
    template = template or config.get("chat_template")
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template}
        template = named.get("default")
    return template if isinstance(template, str) and template else None


def _clean_up_tokenization(text: str) -> str:
    """transformers' clean-up of spaces before punctuation (WordPiece-era output)."""
    for before, after in (
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ):
        text = text.replace(before, after)
    return text
