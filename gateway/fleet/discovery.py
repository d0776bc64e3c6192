"""Ask each engine for its context window (and in-flight limit), in its own dialect.

vLLM/SGLang: ``GET /v1/models`` ``max_model_len``; TGI: ``GET /info`` ``max_total_tokens``
and ``max_input_tokens`` (``max_input_length`` before v2.1), and ``max_concurrent_requests``
(TGI answers 429 beyond it, so the gateway queues instead) and ``version`` (which routes it
has: /v1/completions came in 1.4.4, so OpenAI completions to older ones are translated to
/generate); llama.cpp: ``GET /props`` ``default_generation_settings.n_ctx`` (per slot, which
is what a request gets) and ``total_slots`` (its in-flight limit: a request past it waits
inside the engine, where the balancer cannot see it).
"""

from __future__ import annotations

import logging
from typing import Any

import aiohttp

from gateway.fleet.replica import Replica
from gateway.fleet.served_names import (LISTING_ENGINES, positive_int as _int, read_cards,
                                        read_served_names)

log = logging.getLogger(__name__)


async def _get_json(session: aiohttp.ClientSession, url: str, timeout: float) -> Any:
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout)) as response:
        return await response.json(content_type=None)


async def discover_window(session: aiohttp.ClientSession, replica: Replica,
                          timeout: float) -> bool:
    """Fill ``replica.max_model_len`` from the engine; True when it is known afterwards.
    Engines that list their names (vLLM, SGLang) are read every time: the names they serve
    (aliases, adapters) come from the same answer."""
    if replica.engine in LISTING_ENGINES:
        await read_served_names(session, replica, timeout)
        return replica.max_model_len is not None
    limit_unknown = replica.engine in ("tgi", "llamacpp") and replica.max_concurrent_requests is None
    if replica.max_model_len is not None and not limit_unknown:
        return True
    try:
        if replica.engine == "tgi":
            info = await _get_json(session, f"{replica.url}/info", timeout)
            replica.max_model_len = replica.max_model_len or _int(info.get("max_total_tokens"))
            replica.max_input_tokens = _int(info.get("max_input_tokens")
                                            or info.get("max_input_length"))
            replica.max_concurrent_requests = _int(info.get("max_concurrent_requests"))
            version = info.get("version")
            replica.version = version if isinstance(version, str) else None
        elif replica.engine == "llamacpp":
            props = await _get_json(session, f"{replica.url}/props", timeout)
            replica.max_model_len = replica.max_model_len or _int(
                props.get("default_generation_settings", {}).get("n_ctx"))
            # One request per slot; more wait inside the engine, out of the balancer's sight.
            replica.max_concurrent_requests = _int(props.get("total_slots"))
        else:
            read_cards(replica, await _get_json(session, f"{replica.url}/v1/models", timeout))
    except (aiohttp.ClientError, TimeoutError, ValueError, AttributeError) as exc:
        log.info("could not discover the context window of %s yet: %s", replica.name, exc)
    return replica.max_model_len is not None
