"""Token ids of a request as the engine will see them: the worker's own tokenizer (a
``tokenizer.json`` given in config, loaded with the ``tokenizers`` package) and, for chat
requests, its chat template (Jinja, rendered like Hugging Face ``apply_chat_template``:
``messages``, ``tools``, ``add_generation_prompt=True``, ``bos_token``/``eos_token``;
the result tokenized without adding special tokens). Prompts of /v1/completions and
/generate are tokenized with special tokens, as SGLang does.

The template comes from ``chat_template_path`` or, when the tokenizer path is a directory,
from its ``tokenizer_config.json`` (``chat_template``, ``bos_token``, ``eos_token``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer


class TemplateError(ValueError):
    """The chat template refused the messages (the engine would too)."""


@dataclass
class Tokenization:
    tokenizer: Tokenizer
    template: jinja2.Template | None
    bos_token: str = ""
    eos_token: str = ""

    @staticmethod
    def load(tokenizer_path: str, chat_template_path: str | None = None) -> Tokenization:
        """Raises ValueError naming the file when something cannot be loaded."""
        p = Path(tokenizer_path)
        tok_file = p / "tokenizer.json" if p.is_dir() else p
        try:
            tok = Tokenizer.from_file(str(tok_file))
        except Exception as e:  # noqa: BLE001 - the tokenizers package raises plain Exception
            raise ValueError(f"cannot load tokenizer {tok_file}: {e}") from None
        source, bos, eos = None, "", ""
        cfg_file = (p if p.is_dir() else p.parent) / "tokenizer_config.json"
        if cfg_file.exists():
            try:
                c = json.loads(cfg_file.read_text(encoding="utf-8"))
            except (OSError, ValueError) as e:
                raise ValueError(f"cannot read {cfg_file}: {e}") from None
            source = c.get("chat_template") if isinstance(c.get("chat_template"), str) else None
            bos, eos = _token_text(c.get("bos_token")), _token_text(c.get("eos_token"))
        if chat_template_path:
            try:
                source = Path(chat_template_path).read_text(encoding="utf-8")
            except OSError as e:
                raise ValueError(f"cannot read chat template {chat_template_path}: {e}") from None
        return Tokenization(tok, _compile(source) if source else None, bos, eos)

    def encode_prompt(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=True).ids

    def encode_chat(self, messages: list, tools: object = None) -> list[int] | None:
        """Token ids of a chat request, or None without a chat template."""
        if self.template is None:
            return None
        try:
            text = self.template.render(messages=messages, tools=tools, add_generation_prompt=True,
                                        bos_token=self.bos_token, eos_token=self.eos_token)
        except jinja2.TemplateError as e:
            raise TemplateError(f"the chat template refused the messages: {e}") from None
        return self.tokenizer.encode(text, add_special_tokens=False).ids


def _token_text(v: object) -> str:
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else ""


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


def _compile(source: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(x, indent=indent,
                                                                                   ensure_ascii=ensure_ascii)
    env.globals["raise_exception"] = _raise
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat template does not parse: {e}") from None
