"""Text <-> token ids for the OpenAI routes, with the export's own tokenizer; the chat template.

An export folder may hold ``tokenizer.json`` (Hugging Face tokenizers' format: `tandem data prepare-text
--tokenizer bpe` writes one, and so does the Hugging Face export) and ``tokenizer_config.json`` (the
Hugging Face keys read here: ``bos_token``, ``eos_token``, ``chat_template``, a jinja2 string). Without
``tokenizer.json`` a model of exactly 256 tokens is byte-level (UTF-8 bytes are the ids, as `tandem data
prepare-text` writes them); any other vocabulary without a tokenizer takes token ids only: a text prompt
is refused (400) rather than fed through a tokenizer the model was not trained with.

The chat template is rendered the way transformers renders it (a sandboxed jinja2 environment with
trim_blocks and lstrip_blocks, ``raise_exception``, the variables ``messages``, ``add_generation_prompt``,
``bos_token``, ``eos_token``); with none, DEFAULT_CHAT_TEMPLATE: one ``role: content`` line per message,
then ``assistant:``.
"""

from __future__ import annotations

import json
from pathlib import Path

from tandem.core.errors import ConfigError

BYTE_VOCAB = 256

DEFAULT_CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                         "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")


class NoTokenizer(Exception):
    """The export has no tokenizer and is not byte-level: text cannot be turned into its tokens."""


def _token_text(v) -> str | None:
    """A tokenizer_config special token: a string, or {"content": ...} (AddedToken as transformers saves it)."""
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else None


class TextCodec:
    """The export's tokenizer (``kind``: "hf", "byte", or "none" when text is not possible)."""

    def __init__(self, folder: Path, vocab: int):
        folder = Path(folder)
        self.vocab, self.tok = vocab, None
        cfg_path = folder / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        if (folder / "tokenizer.json").is_file():
            try:
                from tokenizers import Tokenizer  # the serve extra's; only loaded for an export that has one
            except ImportError:
                raise ConfigError("the export has a tokenizer.json; reading it needs the tokenizers library",
                                  field="EXPORT_DIR", value=str(folder),
                                  fix="pip install 'tandem[serve]' (or pip install tokenizers)") from None

            self.tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
            self.kind = "hf"
        else:
            self.kind = "byte" if vocab == BYTE_VOCAB else "none"
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.eos_id = self.token_id(self.eos_token)
        tmpl = cfg.get("chat_template")
        if isinstance(tmpl, list):   # transformers' named templates: [{"name": "default", "template": ...}]
            tmpl = next((t.get("template") for t in tmpl if t.get("name") == "default"), None)
        self.chat_template = tmpl if isinstance(tmpl, str) and tmpl else DEFAULT_CHAT_TEMPLATE
        self._compiled = None

    @property
    def text(self) -> bool:
        return self.kind != "none"

    def token_id(self, token: str | None) -> int | None:
        if token is None or self.tok is None:
            return None
        return self.tok.token_to_id(token)

    def encode(self, text: str, special: bool = True) -> list[int]:
        if self.kind == "none":
            raise NoTokenizer(f"this export has no tokenizer.json and its vocabulary of {self.vocab} is not "
                              f"byte-level ({BYTE_VOCAB}): send token ids, or put the model's tokenizer.json in "
                              f"the export folder")
        if self.tok is None:
            return list(text.encode("utf-8"))
        return self.tok.encode(text, add_special_tokens=special).ids

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids``; an incomplete UTF-8 sequence at the end shows as U+FFFD (held back by
        a streaming caller until the next token completes it)."""
        if self.kind == "none":
            return ""
        if self.tok is None:
            return bytes(t for t in ids if 0 <= t < BYTE_VOCAB).decode("utf-8", errors="replace")
        return self.tok.decode(ids, skip_special_tokens=True)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The conversation as the model's prompt text, through its chat template."""
        if self._compiled is None:
            from jinja2.exceptions import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(msg):
                raise TemplateError(msg)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = raise_exception
            env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
            self._compiled = env.from_string(self.chat_template)
        return self._compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token or "")
