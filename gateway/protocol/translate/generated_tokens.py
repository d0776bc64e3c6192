"""The generated tokens of an OpenAI ``/v1/completions`` choice, as each engine reports them.

vLLM and SGLang (``logprobs`` + ``return_token_ids``): ``token_ids`` in the choice, texts and
logprobs in ``logprobs.tokens`` / ``token_logprobs`` / ``top_logprobs`` (text -> logprob). With
vLLM's ``return_tokens_as_token_ids`` those texts are ``token_id:N`` (how the top tokens' ids
are had), and texts come from the model's tokenizer. llama.cpp: ``logprobs.content`` is a list
of ``{id, token, logprob, top_logprobs: [{id, token, logprob}]}``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.tokens import ModelTokenizer

_ID_PREFIX = "token_id:"


@dataclass(slots=True)
class Token:
    id: int
    text: str
    logprob: float | None
    special: bool = False
    top: list["Token"] | None = None

    def tgi(self) -> dict[str, Any]:
        return {"id": self.id, "text": self.text, "logprob": self.logprob, "special": self.special}


class TokenTexts:
    """Texts of tokens known only by id: incremental decoding, as TGI does (a token's text is
    what it adds to the decoded text before it), and single-id decoding for top tokens."""

    WINDOW = 6  # tokens of left context: enough for a multi-byte character or a word prefix

    def __init__(self, tokenizer: ModelTokenizer) -> None:
        self.tokenizer = tokenizer.tokenizer
        self.ids: list[int] = []
        self.special_ids = tokenizer.special_ids()

    def next(self, token_id: int) -> str:
        context = self.ids[-self.WINDOW:]
        self.ids.append(token_id)
        before = self.tokenizer.decode(context, skip_special_tokens=True) if context else ""
        after = self.tokenizer.decode([*context, token_id], skip_special_tokens=True)
        return after[len(before):] if after.startswith(before) else after

    def one(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def _id_of(text: str) -> int | None:
    if text.startswith(_ID_PREFIX):
        try:
            return int(text[len(_ID_PREFIX):])
        except ValueError:
            return None
    return None


def _top(candidates: list[Token], n: int) -> list[Token]:
    return sorted(candidates, key=lambda t: -(t.logprob if t.logprob is not None else -1e30))[:n]


def choice_tokens(choice: dict[str, Any], content_logprobs: bool, top_n: int,
                  texts: TokenTexts | None) -> list[Token]:
    """Each token of ``choice`` (a whole response's or one stream chunk's), in order;
    ``content_logprobs``: the engine reports them chat-style (``Engine.content_logprobs``)."""
    logprobs = choice.get("logprobs")
    if not isinstance(logprobs, dict):
        return []
    if content_logprobs:
        return [_llamacpp_token(entry, top_n) for entry in logprobs.get("content") or []
                if isinstance(entry, dict)]
    strings = logprobs.get("tokens") or []
    values = logprobs.get("token_logprobs") or []
    tops = logprobs.get("top_logprobs") or []
    ids = choice.get("token_ids") or []
    chunk_text = choice.get("text") or ""
    out = []
    for i, string in enumerate(strings):
        as_id = _id_of(string)
        token_id = as_id if as_id is not None else (ids[i] if i < len(ids) else -1)
        if as_id is None:
            text = string
        elif texts is None:
            text = ""
        elif len(strings) == 1:  # a stream chunk of one token: its text is the engine's own
            texts.ids.append(token_id)
            text = chunk_text
        else:
            text = texts.next(token_id)
        token = Token(token_id, text, values[i] if i < len(values) else None)
        if top_n and i < len(tops) and isinstance(tops[i], dict):
            candidates = []
            for key, value in tops[i].items():
                key_id = _id_of(key)
                candidates.append(Token(-1 if key_id is None else key_id,
                                        key if key_id is None or texts is None else texts.one(key_id),
                                        value))
            token.top = _top(candidates, top_n)
        if texts is not None:
            token.special = token.id in texts.special_ids
            for candidate in token.top or ():
                candidate.special = candidate.id in texts.special_ids
        out.append(token)
    fit_texts(out, chunk_text)
    return out


def fit_texts(tokens: list[Token], text: str) -> None:
    """Make the tokens' texts add up to ``text``, what the engine sent for them (TGI's events
    add up to its generated text). vLLM decodes each token alone for its logprobs, so a byte
    of an unfinished character reads "" there, and the replacement character a broken one
    becomes shows up in the choice's text only: text between two tokens' own texts goes to
    the later token (as TGI's decoder emits it), text after the last to the last."""
    at = 0
    for token in tokens:
        found = text.find(token.text, at) if token.text else at
        if found < 0:  # not sent yet (the engine holds it back): a later token carries it
            token.text = ""
            continue
        token.text, at = text[at:found] + token.text, found + len(token.text)
    if tokens and at < len(text):
        tokens[-1].text += text[at:]


def _llamacpp_token(entry: dict[str, Any], top_n: int) -> Token:
    token = Token(int(entry.get("id", -1)), str(entry.get("token", "")), entry.get("logprob"))
    if top_n:
        token.top = _top([Token(int(c.get("id", -1)), str(c.get("token", "")), c.get("logprob"))
                          for c in entry.get("top_logprobs") or [] if isinstance(c, dict)], top_n)
    return token


def merged_tokens(count: int, top_n: int) -> list[Token]:
    """Tokens the engine generated but did not report one by one: llama.cpp sends tokens that
    end inside a UTF-8 character together with the token that completes it, as one entry
    (the completing token's id and logprob, the whole character as its text). TGI's own
    events for such tokens carry an empty text (its decoder holds an incomplete character
    back), which these do too; their ids and logprobs are not on llama.cpp's wire (-1, null)."""
    return [Token(-1, "", None, top=[] if top_n else None) for _ in range(count)]


def mark_eos(tokens: list[Token], eos_finish: bool, texts: TokenTexts | None) -> None:
    """Without the tokenizer's special ids, the one special token a generation holds is the
    end-of-sequence token: the last token, empty in the text, of a sequence that ended on it."""
    if texts is None and eos_finish and tokens and tokens[-1].text == "":
        tokens[-1].special = True
