"""The frontend's tokenizer (the `tokenizers` library and a jinja2 sandbox, no transformers)
against Hugging Face's AutoTokenizer on the same files: token ids with and without special
tokens, text with and without them, rendered chats; and variants of the files (add_bos_token
in the config, a template listed in the config, a tokenizer without a template, a template
that raises or reaches outside its sandbox)."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from frontend_svc.messages import ChatMessage
from frontend_svc.tokenizer import Tokenizer
from shared.errors import InvalidRequestError

TEXTS = [
    "Hello, world!",
    "  leading and trailing spaces  ",
    "The quick brown fox jumps over the lazy dog. Don't stop; it's 3.14 o'clock?",
    "日本語のテキストと中文文本",
    "emoji 🤖🚀 and accents: café, naïve, Ωmega",
    "<|im_start|>user\nspecial tokens written as text<|im_end|>",
    "tabs\tand\nnewlines\n\n",
    "",
]
CONVERSATIONS = [
    [ChatMessage("user", "What is the capital of France?")],
    [
        ChatMessage("system", "You are brief."),
        ChatMessage("user", "Hi!"),
        ChatMessage("assistant", "Hello."),
        ChatMessage("user", "Tell me a joke about 🐍."),
    ],
]


def _hf(directory: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)


def _copy_tokenizer(source: Path, target: Path, **config_changes: object) -> Path:
    target.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (source / name).is_file():
            shutil.copy(source / name, target / name)
    config = json.loads((target / "tokenizer_config.json").read_text())
    config.update(config_changes)
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    return target


def _assert_same(ours: Tokenizer, hf, conversations: bool = True) -> None:  # type: ignore[no-untyped-def]
    for text in TEXTS:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == hf.encode(
                text, add_special_tokens=special
            ), (text, special)
    rng = random.Random(0)
    vocab = ours.vocab_size
    assert vocab == len(hf)
    samples = [hf.encode(text) for text in TEXTS] + [
        [rng.randrange(vocab) for _ in range(40)] for _ in range(30)
    ]
    special_ids = sorted(hf.all_special_ids)
    samples.append(special_ids + samples[2] + special_ids)
    for ids in samples:
        for skip in (True, False):
            assert ours.decode(ids, skip) == hf.decode(ids, skip_special_tokens=skip), (ids, skip)
    if not conversations:
        return
    for messages in CONVERSATIONS:
        for prompt in (True, False):
            dicts = [{"role": m.role, "content": m.content} for m in messages]
            expected = hf.apply_chat_template(dicts, add_generation_prompt=prompt, tokenize=False)
            assert ours.render_chat(messages, prompt) == hf.encode(
                expected, add_special_tokens=False
            )


def test_the_default_models_tokenizer_matches_transformers(default_model_dir: Path) -> None:
    _assert_same(Tokenizer.load(default_model_dir), _hf(default_model_dir))


def test_special_tokens_come_from_tokenizer_json_as_in_transformers(
    default_model_dir: Path, tmp_path: Path
) -> None:
    """A config's add_bos_token does not change what this tokenizer class adds, there too."""
    directory = _copy_tokenizer(
        default_model_dir, tmp_path / "bos", add_bos_token=True, add_eos_token=True
    )
    _assert_same(Tokenizer.load(directory), _hf(directory), conversations=False)


def test_a_template_in_the_config_list_and_no_clean_up_differences(
    default_model_dir: Path, tmp_path: Path
) -> None:
    template = (
        "{% for m in messages %}{% generation %}<{{ m.role }}>{{ m.content | tojson }}"
        "{% endgeneration %}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    directory = _copy_tokenizer(
        default_model_dir,
        tmp_path / "listed",
        chat_template=[{"name": "default", "template": template}],
        clean_up_tokenization_spaces=True,  # transformers ignores it for BPE, as we do
    )
    (directory / "chat_template.jinja").unlink()
    _assert_same(Tokenizer.load(directory), _hf(directory))


def test_a_tokenizer_without_a_template_refuses_messages(
    default_model_dir: Path, tmp_path: Path
) -> None:
    directory = _copy_tokenizer(default_model_dir, tmp_path / "plain")
    (directory / "chat_template.jinja").unlink()
    tokenizer = Tokenizer.load(directory)
    assert not tokenizer.has_chat_template
    with pytest.raises(InvalidRequestError, match="no chat template"):
        tokenizer.render_chat(CONVERSATIONS[0])


def test_a_failing_template_is_an_invalid_request(default_model_dir: Path, tmp_path: Path) -> None:
    directory = _copy_tokenizer(default_model_dir, tmp_path / "strict")
    (directory / "chat_template.jinja").write_text(
        "{% if messages[0].role != 'system' %}{{ raise_exception('a system message first') }}"
        "{% endif %}{% set ns = namespace(_secret=1) %}"
    )
    tokenizer = Tokenizer.load(directory)
    with pytest.raises(InvalidRequestError, match="a system message first"):
        tokenizer.render_chat(CONVERSATIONS[0])
    with pytest.raises(InvalidRequestError, match="underscore-prefixed"):  # the sandbox's rules
        tokenizer.render_chat([ChatMessage("system", "x")])
