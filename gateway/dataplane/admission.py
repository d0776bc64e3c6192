"""Admission: the request's model, the replicas that can serve it (its dialect, natively or
translated; its pool, by the canary split) and, of those, the ones whose context window
holds it, with what it will cost them.

The rule is the engines' own: reject ``prompt + max_tokens > window``, and
``prompt >= window`` when ``max_tokens`` is absent. The prompt is counted exactly (the model's
tokenizer and chat template) only when a cheap upper bound cannot already prove the request
fits every candidate; below that bound the ledger uses an estimate of
``ceil(bytes / ESTIMATED_BYTES_PER_TOKEN)``. A long request (``COUNT_OFF_LOOP_BYTES``) is
counted in a worker thread before admission (``Admitter.prepare``), never on the event loop.

Without a tokenizer the gateway cannot count, so it only rejects what needs no count
(``max_tokens`` larger than every window) and lets the engine judge the rest: an engine's own
context 400 reaches the client in the client's shape with ``code: context_length_exceeded``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Awaitable

from gateway.balance.policy import RequestCost
from gateway.balance.prefix_index import prompt_blocks, token_blocks
from gateway.balance.pool_split import PoolSplit
from gateway.fleet.adapter_loader import AdapterLoader
from gateway.fleet.model import ServedModel
from gateway.fleet.replica import Replica
from gateway.fleet.response_homes import ResponseHomes
from gateway.fleet.served_names import ServedNames
from gateway.kvcache.index import PromptKeys
from gateway.protocol.errors import Api, ContextLengthExceeded, InvalidRequest, ModelNotFound
from gateway.protocol.request import MAX_SESSION_CHARS, NO_CONTEXT, Context, GenerationRequest
from gateway.protocol.responses import ResponseNotFound
from gateway.protocol.translate import TranslationPlan, servable
from gateway.tokens import ChatTemplateError, ModelTokenizer, flatten_content

ESTIMATED_BYTES_PER_TOKEN = 4
# A request body this long is tokenized in a worker thread, not on the event loop: counting
# takes 0.3-0.5 µs a character (a 1 MB prompt: up to half a second), and on the loop no
# stream would move meanwhile. The tokenizer lets go of the GIL while it counts (tokens.py);
# below this a count takes a few ms at most.
COUNT_OFF_LOOP_BYTES = 16 * 1024


@dataclass(frozen=True, slots=True)
class Prepared:
    """What admission learned before it could admit (``Admitter.prepare``)."""

    pinned: str | None = None  # the one replica that may serve it (where its Response lives)
    prompt_counts: list[int] | None = None  # its prompts' exact token counts, when taken
    prompt_ids: list[int] | None = None  # its one prompt's token ids, when taken (KV events)


@dataclass(slots=True)
class Admission:
    """What admission decided: the cost, the replicas that may serve it, and what the
    engine's body must say that the client's did not (``output_cap``)."""

    cost: RequestCost
    replicas: list[Replica]  # the candidates whose window holds the request
    prompt_tokens_exact: bool
    name: str = ""  # the model name served (the client's, or the default model's)
    adapter: str | None = None  # ``name`` when it is a LoRA adapter (a replica lists a parent)
    output_cap: int | None = None  # max output tokens lowered to fit (output_past_window: cap)
    prompt_counts: list[int] | None = None  # the prompts' exact token counts, when taken
    plan: TranslationPlan | None = None  # what translation parsed of it (TGI requests)


NOT_PREPARED = Prepared()  # what a request with nothing to prepare brings (no allocation)


@dataclass(slots=True)
class _Prompt:
    """One prompt to count: text (with its special-token rule) or token ids."""

    text: str | None = None
    add_special_tokens: bool = True
    ids: list[int] | None = None

    def byte_length(self) -> int:
        return len((self.text or "").encode("utf-8"))

    def upper_bound(self, tokenizer: ModelTokenizer) -> int:
        """>= the exact count: a token covers at least one byte (see tokens.py)."""
        if self.ids is not None:
            return len(self.ids)
        return self.byte_length() + tokenizer.special_token_slack(self.add_special_tokens)

    def count(self, tokenizer: ModelTokenizer) -> int:
        if self.ids is not None:
            return len(self.ids)
        return tokenizer.count_text(self.text or "", self.add_special_tokens)

    def token_ids(self, tokenizer: ModelTokenizer) -> list[int]:
        """The ids the engine will see (its chat template rendered, as for counting)."""
        if self.ids is not None:
            return self.ids
        return tokenizer.token_ids(self.text or "", self.add_special_tokens)

    def estimate(self) -> int:
        if self.ids is not None:
            return len(self.ids)
        return -(-self.byte_length() // ESTIMATED_BYTES_PER_TOKEN)


def _prompts(request: GenerationRequest, tokenizer: ModelTokenizer | None) -> list[_Prompt]:
    body = request.as_chat if request.as_chat is not None else request.body
    if request.messages is not None:
        add_special = bool(body.get("add_special_tokens", False))
        if tokenizer is None:  # only an estimate is possible: the content itself
            text = "".join(str(flatten_content(m.get("content")) or "") for m in request.messages)
            return [_Prompt(text, add_special)]
        try:
            text = tokenizer.render_chat(
                request.messages,
                add_generation_prompt=body.get("add_generation_prompt", True) is not False,
                continue_final_message=body.get("continue_final_message") is True,
                tools=body.get("tools") if isinstance(body.get("tools"), list) else None,
                chat_template_kwargs=_dict_or_none(body.get("chat_template_kwargs")),
            )
        except ChatTemplateError as exc:
            raise InvalidRequest(str(exc), param="messages") from None
        return [_Prompt(text, add_special)]
    add_special = body.get("add_special_tokens", True) is not False
    prompt = request.prompt
    if isinstance(prompt, str):
        return [_Prompt(prompt, add_special)]
    assert isinstance(prompt, list)
    if prompt and isinstance(prompt[0], int):
        return [_Prompt(ids=prompt)]  # type: ignore[arg-type]
    return [_Prompt(p, add_special) if isinstance(p, str) else _Prompt(ids=p) for p in prompt]


def _affinity(request: GenerationRequest, context: Context,
              prompts: list[_Prompt]) -> tuple[tuple[int, ...], str | None]:
    """What prefix-aware balancing needs: the prompt's hashed prefix blocks (one prompt
    only) and the client's session (``x-session-id``, else OpenAI's ``user``)."""
    blocks: tuple[int, ...] = ()
    if len(prompts) == 1:
        prompt = prompts[0]
        blocks = (token_blocks(prompt.ids) if prompt.ids is not None
                  else prompt_blocks(prompt.text or ""))
    body = request.as_chat if request.as_chat is not None else request.body
    session = context.session or body.get("user")
    if not isinstance(session, str) or not 0 < len(session) <= MAX_SESSION_CHARS:
        session = None
    return blocks, session


def _dict_or_none(value: Any) -> dict[str, Any] | None:
    return value if isinstance(value, dict) else None


def _fits(model: ServedModel, replica: Replica, prompt_tokens: int,
          max_tokens: int | None) -> bool:
    window = model.window(replica)
    if replica.max_input_tokens is not None and prompt_tokens > replica.max_input_tokens:
        return False
    if window is None:
        return True
    if max_tokens is None:
        return prompt_tokens < window
    return prompt_tokens + max_tokens <= window


def _bound_fits(model: ServedModel, tokenizer: ModelTokenizer, prompts: list[_Prompt],
                replicas: list[Replica], max_tokens: int | None) -> bool:
    """Does the one-token-per-byte bound already prove the prompts fit every replica?"""
    bound = max(p.upper_bound(tokenizer) for p in prompts)
    return all(_fits(model, r, bound, max_tokens) for r in replicas)


def _capped(model: ServedModel, candidates: list[Replica],
            prompt_tokens: int) -> tuple[list[Replica], int | None]:
    """``output_past_window: cap``: the replicas with the most room after the prompt, and
    that room, the output cap (None when the prompt alone is too long)."""
    room = {id(r): model.window(r) - prompt_tokens for r in candidates  # type: ignore[operator]
            if model.window(r) is not None and _fits(model, r, prompt_tokens, None)}
    if not room:
        return [], None
    most = max(room.values())
    return [r for r in candidates if room.get(id(r)) == most], most


def _keyed_by_events(tokenizer: ModelTokenizer | None, prompts: list[_Prompt],
                     candidates: list[Replica]) -> bool:
    """Does precise prefix routing need this prompt's token ids? One prompt, a tokenizer,
    and a candidate whose engine's KV events the gateway follows."""
    return (tokenizer is not None and len(prompts) == 1
            and any(r.kv_cache is not None for r in candidates))


def _cache_salt(request: GenerationRequest) -> str | None:
    salt = request.body.get("cache_salt")
    return salt if isinstance(salt, str) and salt else None


def admit(model: ServedModel, request: GenerationRequest, candidates: list[Replica],
          context: Context = NO_CONTEXT, counts: list[int] | None = None,
          prompt_ids: list[int] | None = None, adapter: str | None = None) -> Admission:
    """Check the window against ``candidates``; raise ContextLengthExceeded when none fits.
    ``counts``, ``prompt_ids``: the prompts' exact token counts, the one prompt's ids, if
    already taken; ``adapter``: the LoRA adapter served (part of a KV block's key)."""
    tokenizer = model.tokenizer
    prompts = _prompts(request, tokenizer)
    max_tokens = request.max_tokens
    fanout = request.choices * len(prompts)
    # A pooling request (max_tokens 0) costs its input alone.
    output_tokens = (max_tokens if max_tokens is not None else model.default_output_tokens) * fanout
    affinity = _affinity(request, context, prompts)
    # Precise prefix routing keys the prompt by its token ids; what the prompt costs is
    # counted as without it (the ids make an exact count free where one is needed).
    keys = None
    if _keyed_by_events(tokenizer, prompts, candidates):
        prompt_ids = prompt_ids if prompt_ids is not None else prompts[0].token_ids(tokenizer)
        keys = PromptKeys(prompt_ids, adapter, _cache_salt(request))

    if tokenizer is None:
        estimate = sum(p.estimate() for p in prompts)
        cost = RequestCost(estimate, output_tokens, *affinity)
        known = [w for w in (model.window(r) for r in candidates) if w is not None]
        if max_tokens is not None and known and len(known) == len(candidates):
            fitting = [r for r in candidates if max_tokens <= (model.window(r) or 0)]
            if not fitting:
                raise ContextLengthExceeded.output_too_large(max(known), max_tokens, request.api)
            return Admission(cost, fitting, False)
        return Admission(cost, candidates, False)

    if counts is None:
        if _bound_fits(model, tokenizer, prompts, candidates, max_tokens):
            return Admission(RequestCost(sum(p.estimate() for p in prompts), output_tokens,
                                         *affinity, keys), candidates, False)
        counts = ([len(prompt_ids)] if keys is not None and prompt_ids is not None
                  else [p.count(tokenizer) for p in prompts])
    longest = max(counts)
    fitting = [r for r in candidates if _fits(model, r, longest, max_tokens)]
    cap = None
    if not fitting and model.cap_output and max_tokens:
        fitting, cap = _capped(model, candidates, longest)
        if cap is not None:
            max_tokens = cap
            output_tokens = cap * fanout
    if not fitting:
        windows = [w for w in (model.window(r) for r in candidates) if w is not None]
        limit = max(windows) if windows else longest
        raise ContextLengthExceeded(limit, longest, max_tokens, request.api, request.is_chat)
    return Admission(RequestCost(sum(counts), output_tokens, *affinity, keys), fitting, True,
                     output_cap=cap, prompt_counts=counts)


def exact_tokens(model: ServedModel, serving: list[Replica],
                 request: GenerationRequest) -> Prepared:
    """What ``admit`` would tokenize for one of ``serving``: the one prompt's ids when
    precise prefix routing needs them, and the prompts' exact counts unless the
    one-token-per-byte bound fits every replica (or there is no tokenizer)."""
    tokenizer = model.tokenizer
    if tokenizer is None:
        return NOT_PREPARED
    prompts = _prompts(request, tokenizer)
    ids = prompts[0].token_ids(tokenizer) if _keyed_by_events(tokenizer, prompts, serving) else None
    if _bound_fits(model, tokenizer, prompts, serving, request.max_tokens):
        return Prepared(prompt_ids=ids)
    return Prepared(prompt_counts=[len(ids)] if ids is not None
                    else [p.count(tokenizer) for p in prompts], prompt_ids=ids)


class Admitter:
    """Model name -> the model, and the replicas of it that can take a request."""

    def __init__(self, models: dict[str, ServedModel], default_model: str | None,
                 split: PoolSplit, adapters: AdapterLoader | None = None,
                 homes: ResponseHomes | None = None) -> None:
        self.models = models
        self.names = ServedNames(models)  # aliases and adapters too
        self.default_model = default_model or (next(iter(models)) if len(models) == 1 else None)
        self.split = split
        self.adapters = adapters  # LoRA adapters loaded at run time (load_adapters)
        self.loadable = frozenset(n for m in models.values() for n in m.load_adapters)
        self.homes = homes  # where stored Responses live

    def prepare(self, request: GenerationRequest) -> Awaitable[Prepared] | None:
        """What admission must know first and may have to wait for, to be awaited before
        ``admit``: an adapter to load at run time, the replica that stored the Response the
        request continues, or a long prompt's token count (taken in a worker thread). None
        (nothing to wait for) for every other request."""
        if (request.previous_response_id is None and request.model not in self.loadable
                and len(request.raw) < COUNT_OFF_LOOP_BYTES):
            return None
        return self._prepare(request)

    async def _prepare(self, request: GenerationRequest) -> Prepared:
        if self.adapters is not None and request.model in self.loadable:
            await self.adapters.ensure(*self.resolve(request.model, request.api))
        pinned, tokens = None, NOT_PREPARED
        previous = request.previous_response_id
        if previous is not None:  # pinned where it lives (raises when that is unknown)
            pinned = await self.homes.home(previous) if self.homes is not None else None
            if pinned is None:
                raise ResponseNotFound(previous)
        if len(request.raw) >= COUNT_OFF_LOOP_BYTES:  # after the adapter: its name resolves
            model, name = self.resolve(request.model, request.api)
            serving = list(model.replicas_for(name))  # read on the loop, which changes it
            tokens = await asyncio.to_thread(exact_tokens, model, serving, request)
        return Prepared(pinned, tokens.prompt_counts, tokens.prompt_ids)

    def model_for(self, name: str | None, api: Api) -> ServedModel:
        """The model serving ``name`` (see ``resolve``)."""
        return self.resolve(name, api)[0]

    def resolve(self, name: str | None, api: Api) -> tuple[ServedModel, str]:
        """The model serving ``name`` (an entry's name, an alias or an adapter) and the name
        served. Requests without a name (TGI's, nameless OpenAI ones) get the default model;
        so does a TGI ``adapter_id`` no replica lists (a TGI engine judges it itself)."""
        if name is not None:
            model = self.names.resolve(name)
            if model is not None:
                return model, name
            if api is not Api.TGI:
                raise ModelNotFound(name)
        default = self.default_model
        if default is None:
            raise ModelNotFound("(none given; several models are served, name one)")
        return self.models[default], default

    def admit(self, request: GenerationRequest, context: Context = NO_CONTEXT,
              prepared: Prepared = NOT_PREPARED) -> tuple[ServedModel, Admission]:
        """The request's model, cost and the replicas whose window it fits (else raise).
        ``prepared``: what ``prepare`` returned, if it returned something to await."""
        model, name = self.resolve(request.model, request.api)
        # Only the replicas serving the name (an adapter lives on some replicas only).
        serving = model.replicas_for(name)
        if not serving:
            raise ModelNotFound(name)  # an adapter no replica serves (any longer)
        pinned = prepared.pinned
        if pinned is not None:  # a stored Response's replica, or nothing
            serving = [r for r in serving if r.name == pinned]
            if not serving:
                raise ResponseNotFound(request.previous_response_id or "")
        # TGI parameters are parsed once, for every replica and attempt (translation's).
        parsed = TranslationPlan(request) if request.api is Api.TGI else None
        # Natively or translated; a replica that cannot honour every parameter is left out.
        speakers = servable(request, serving, model.tokenizer is not None, parsed)
        # The pool: forced by the client, else any that takes primary traffic (canary split).
        speakers = self.split.candidates(model, request, context, speakers)
        adapter = name if self.names.parent(name, model) is not None else None
        admission = admit(model, request, speakers, context, prepared.prompt_counts,
                          prepared.prompt_ids, adapter)
        admission.name, admission.adapter = name, adapter
        admission.plan = parsed
        return model, admission
