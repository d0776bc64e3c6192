"""Ask each engine for its context window (and in-flight limit), in its own dialect.

Engines that list their names (vLLM, SGLang, OpenAI-compatible) give ``max_model_len`` on
``GET /v1/models``; the others describe themselves on their ``info_path`` (TGI ``/info``:
window, prompt limit, in-flight limit, version; llama.cpp ``/props``: window per slot and slot
count), read by the engine's ``read_info`` (``gateway/engines/``).
"""

from __future__ import annotations

import logging
from typing import Any

import aiohttp

from gateway.fleet.replica import Replica
from gateway.fleet.served_names import read_served_names

log = logging.getLogger(__name__)


async def _get_json(session: aiohttp.ClientSession, url: str, timeout: float) -> Any:
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout)) as response:
        return await response.json(content_type=None)


async def discover_window(session: aiohttp.ClientSession, replica: Replica,
                          timeout: float) -> bool:
    """Fill ``replica.max_model_len`` from the engine; True when it is known afterwards.
    Engines that list their names (vLLM, SGLang) are read every time: the names they serve
    (aliases, adapters) come from the same answer."""
    engine = replica.profile
    if engine.lists_models:
        await read_served_names(session, replica, timeout)
        return replica.max_model_len is not None
    if engine.info_path is None or (replica.max_model_len is not None
                                    and replica.max_concurrent_requests is not None):
        return replica.max_model_len is not None
    try:
        info = engine.read_info(await _get_json(session, replica.url + engine.info_path, timeout))
    except (aiohttp.ClientError, TimeoutError, ValueError, AttributeError) as exc:
        log.info("could not discover the context window of %s yet: %s", replica.name, exc)
    else:
        replica.max_model_len = replica.max_model_len or info.max_model_len
        replica.max_input_tokens = info.max_input_tokens
        replica.max_concurrent_requests = info.max_concurrent_requests
        replica.version = info.version
    return replica.max_model_len is not None
