"""Which broken streams can go on elsewhere exactly, and why the others cannot.

A continuation is the prompt's token ids plus the ids generated so far, sent as a prompt to
another replica with the same sampling parameters and ``max_tokens`` less what was sent
(``gateway.migrate.continuation``). With greedy decoding it is the uninterrupted answer; with
sampling, a sample of the same distribution. That holds only where the engine's output
depends on nothing but those ids and parameters; each case below was decided from what vLLM
0.32 does (read in its source, checked on the CPU build):

- ``stop`` strings: vLLM holds back the last characters that could begin a stop string and
  checks stops only in text it generated itself, so text held back at the break would be
  lost and a stop string spanning the break missed.
- ``n`` > 1 (or ``best_of``): the choices share one stream; one cannot be resumed alone.
- ``logprobs``: a continuation's ``text_offset`` restarts and chat logprobs have their own
  shape; not rewritten.
- ``tools``: the engine's tool-call parser holds state across the stream.
- structured output (``response_format``, ``structured_outputs``, ``guided_*``, TGI
  ``grammar``): the grammar's state would restart at the break.
- ``presence_penalty``/``frequency_penalty``: vLLM applies them to generated tokens only;
  in a continuation those tokens are prompt. (``repetition_penalty`` covers both: exact.)
- ``suffix``, TGI ``watermark``: not served alike from a token prompt.
- engines that cannot take a prompt as ids and return generated ids (``Engine.continues``).
- routes other than OpenAI completions and chat and TGI's generation (the Responses API),
  and a canary's shadow copies (their answers go nowhere).

At the break, more can stop it: the engine's stream lacked ids (a reasoning parser hiding
them), the window or the tokens left are unknown, the retry budget or the migration
attempts are spent, or no other replica of the pool can take it.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

from gateway.engines import Engine
from gateway.protocol.errors import Api
from gateway.protocol.request import GenerationRequest


class NotContinued(Enum):
    """Why a broken stream ended with an error event instead of going on elsewhere."""

    DISABLED = "disabled"
    ROUTE = "route"
    SHADOW = "shadow"
    ENGINE = "engine"
    CHOICES = "n"
    STOP = "stop"
    LOGPROBS = "logprobs"
    TOOLS = "tools"
    STRUCTURED_OUTPUT = "structured_output"
    PENALTIES = "penalties"
    SUFFIX = "suffix"
    WATERMARK = "watermark"
    NO_TOKEN_IDS = "no_token_ids"
    NO_TOKENS_LEFT = "no_tokens_left"
    HELD = "held"  # more than MAX_HELD tokens whose text the engine held back (broken UTF-8)
    ATTEMPTS = "attempts"
    BUDGET = "budget"
    NO_REPLICA = "no_replica"

    @property
    def label(self) -> str:
        return self.value


CONTINUED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})  # and TGI's
_STRUCTURED = ("structured_outputs", "guided_json", "guided_regex", "guided_choice",
               "guided_grammar", "guided_whitespace_pattern")


def refusal(request: GenerationRequest, engine: Engine) -> NotContinued | None:
    """None when ``request`` on ``engine`` can be continued exactly after a break."""
    if (request.api is Api.OPENAI and request.path not in CONTINUED_PATHS
            or request.api is Api.ANTHROPIC):  # Anthropic's events: not continued yet
        return NotContinued.ROUTE
    if request.shadow:  # a canary's copy: its answer goes nowhere
        return NotContinued.SHADOW
    if not engine.continues:
        return NotContinued.ENGINE
    if request.choices != 1:
        return NotContinued.CHOICES
    if request.api is Api.TGI:
        return _tgi_refusal(request.body.get("parameters") or {})
    return _openai_refusal(request.body, request.is_chat)


def _tgi_refusal(p: dict[str, Any]) -> NotContinued | None:
    if p.get("stop"):
        return NotContinued.STOP
    if (p.get("best_of") or 1) > 1:
        return NotContinued.CHOICES
    if p.get("grammar") is not None:
        return NotContinued.STRUCTURED_OUTPUT
    if p.get("frequency_penalty"):
        return NotContinued.PENALTIES
    if p.get("watermark"):
        return NotContinued.WATERMARK
    return None


def _openai_refusal(body: dict[str, Any], chat: bool) -> NotContinued | None:
    if body.get("stop"):
        return NotContinued.STOP
    if (body.get("best_of") or 1) > 1:
        return NotContinued.CHOICES
    if (body.get("logprobs") if chat else body.get("logprobs") is not None) or \
            body.get("prompt_logprobs") is not None:
        return NotContinued.LOGPROBS
    if body.get("tools"):
        return NotContinued.TOOLS
    response_format = body.get("response_format")
    if (isinstance(response_format, dict) and response_format.get("type") not in (None, "text")) \
            or any(body.get(name) is not None for name in _STRUCTURED):
        return NotContinued.STRUCTURED_OUTPUT
    if body.get("presence_penalty") or body.get("frequency_penalty"):
        return NotContinued.PENALTIES
    if body.get("suffix"):
        return NotContinued.SUFFIX
    return None
