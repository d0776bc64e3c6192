"""Prompt token counting, exactly as the engines count.

A model directory holds ``tokenizer.json`` and a chat template (``chat_template.jinja``,
the ``chat_template`` key of ``tokenizer_config.json``, or a legacy ``chat_template.json``).
Chat prompts are rendered the way transformers renders them (sandboxed jinja2 with
``trim_blocks``/``lstrip_blocks``, its ``tojson``, ``raise_exception`` and ``strftime_now``)
and encoded with ``add_special_tokens=False``, as vLLM does for chat; completion prompts
are encoded with ``add_special_tokens=True``.

Exact counting costs real CPU on long prompts, so callers first ask for an upper bound:
a token of a byte-level (or byte-fallback) tokenizer covers at least one byte of input, so
``utf8 bytes + tokens the post-processor adds + 1`` bounds the count from above.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from gateway.token_cache import SegmentTokenCache

Message = dict[str, Any]

SPECIAL_TOKEN_KEYS = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
)


class ChatTemplateError(ValueError):
    """The chat template could not render these messages (a client error)."""


class _GenerationTag(jinja2.ext.Extension):
    """transformers' ``{% generation %}`` block; rendering only needs its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=64)
def _compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json stores special tokens as strings or AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _read_chat_template(model_dir: Path, config: dict[str, Any]) -> str | None:
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if template is None:
        legacy = model_dir / "chat_template.json"
        if legacy.is_file():
            template = json.loads(legacy.read_text(encoding="utf-8")).get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    return template


def flatten_content(content: Any) -> Any:
    """vLLM's "string" content format: text parts of a list are joined with newlines."""
    if isinstance(content, list):
        return "\n".join(
            part.get("text", "") for part in content
            if isinstance(part, dict) and part.get("type", "text") == "text"
        )
    return content


class ModelTokenizer:
    """The tokenizer and chat template of one model directory."""

    def __init__(self, tokenizer: Tokenizer, chat_template: str | None,
                 special_tokens: dict[str, Any], name: str = "") -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.special_tokens = special_tokens
        self.name = name
        # Tokens the post-processor adds with add_special_tokens=True (e.g. BOS).
        self.added_by_post_processor = len(tokenizer.encode("", add_special_tokens=True).ids)
        self._special_ids: frozenset[int] | None = None
        # Counting needs no offsets: encode_batch_fast skips them (the same ids, 1.2-3x
        # faster) and, unlike encode, lets go of the GIL while it works, so a long prompt
        # counted in a worker thread leaves the event loop free. (Older tokenizers: without
        # _fast.)
        self._encode_many = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
        self.cache: SegmentTokenCache | None = None  # the prefix token cache (enable_cache)

    def enable_cache(self, max_bytes: int) -> None:
        """Take prompts' ids from a prefix token cache of ``max_bytes`` (``gateway.token_cache``;
        0: none). A tokenizer shared by several models keeps the largest size asked for."""
        if max_bytes <= 0:
            return
        if self.cache is None:
            self.cache = SegmentTokenCache(self.tokenizer, max_bytes)
        else:
            self.cache.max_bytes = max(self.cache.max_bytes, max_bytes)

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelTokenizer":
        """Load ``tokenizer.json`` + chat template from a local model directory."""
        model_dir = Path(path)
        tokenizer_file = model_dir / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in model directory {model_dir}")
        config_file = model_dir / "tokenizer_config.json"
        config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
        special = {k: _token_content(config.get(k)) for k in SPECIAL_TOKEN_KEYS}
        special["additional_special_tokens"] = [
            _token_content(t) for t in config.get("additional_special_tokens", [])
        ]
        return cls(Tokenizer.from_file(str(tokenizer_file)), _read_chat_template(model_dir, config),
                   special, name=model_dir.name)

    # --- plain text (completions) ---

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def count_text(self, text: str, add_special_tokens: bool = True) -> int:
        return len(self.token_ids(text, add_special_tokens))

    def token_ids(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``encode``'s ids the way counting takes them: from the prefix token cache where it
        is on, else tokenized (faster than ``encode``, and the GIL let go)."""
        if self.cache is not None:
            ids = self.cache.ids(text, add_special_tokens)
            if ids is not None:
                return ids
        return self._encode_many([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def special_ids(self) -> frozenset[int]:
        """Ids of the special tokens (BOS, EOS, ...): TGI marks them ``special`` in details."""
        if self._special_ids is None:
            self._special_ids = frozenset(
                i for i, token in self.tokenizer.get_added_tokens_decoder().items() if token.special)
        return self._special_ids

    def special_token_slack(self, add_special_tokens: bool = True) -> int:
        """Tokens beyond one per byte: those the post-processor adds, plus one for a prefix
        space a metaspace pre-tokenizer may add."""
        return (self.added_by_post_processor if add_special_tokens else 0) + 1

    # --- chat ---

    def render_chat(self, messages: list[Message], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, tools: list[Any] | None = None,
                    chat_template: str | None = None,
                    chat_template_kwargs: dict[str, Any] | None = None) -> str:
        """Render messages to the prompt string, as transformers' apply_chat_template does."""
        template = chat_template or self.chat_template
        if template is None:
            raise ChatTemplateError("this model has no chat template; use /v1/completions")
        conversation = [{**m, "content": flatten_content(m.get("content"))} for m in messages]
        variables: dict[str, Any] = {k: v for k, v in self.special_tokens.items() if v is not None}
        variables.update(chat_template_kwargs or {})
        try:
            rendered = _compile_template(template).render(
                messages=conversation, tools=tools, documents=None,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                **variables,
            )
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"chat template error: {exc}") from exc
        if continue_final_message and conversation:
            final = conversation[-1].get("content") or ""
            final = final.strip() if isinstance(final, str) else ""
            if final and final in rendered:
                rendered = rendered[: rendered.rindex(final) + len(final)]
        return rendered

    def count_chat(self, messages: list[Message], **render_kwargs: Any) -> int:
        """Prompt tokens of a chat request: rendered, then encoded without special tokens."""
        return self.count_text(self.render_chat(messages, **render_kwargs), add_special_tokens=False)


@lru_cache(maxsize=16)
def load_tokenizer(path: str) -> ModelTokenizer:
    """Load (once per process) the tokenizer of a model directory."""
    return ModelTokenizer.from_dir(path)
