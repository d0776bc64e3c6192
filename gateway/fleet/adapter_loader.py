"""LoRA adapters loaded at run time: a request for an adapter of ``load_adapters`` that no
replica serves yet loads it on the least-loaded available vLLM replica of its model
(``POST /v1/load_lora_adapter {"lora_name", "lora_path"}``; the engine needs
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``), and the gateway remembers where it now lives
(the replica's served names; its next /v1/models read confirms it). Concurrent requests for
the same adapter wait for one load.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

import aiohttp

from gateway.fleet.model import ServedModel
from gateway.fleet.replica import Replica
from gateway.protocol.errors import GatewayError
from gateway.protocol.reasons import Reason

log = logging.getLogger(__name__)

class AdapterLoadFailed(GatewayError):
    status = 503
    openai_type = "server_error"
    tgi_type = "generation"
    code = "adapter_load_failed"
    reason = Reason.NO_REPLICA


class AdapterLoader:
    def __init__(self, session: Callable[[], aiohttp.ClientSession],
                 outstanding: Callable[[str], int], timeout: float) -> None:
        self.session = session  # the probe session (exists once the gateway has started)
        self.outstanding = outstanding  # replica name -> tokens the ledger has there
        self.timeout = timeout
        self._loading: dict[tuple[str, str], asyncio.Task[Replica]] = {}

    async def ensure(self, model: ServedModel, name: str | None) -> None:
        """Make ``name`` served by a replica of ``model`` if it is an adapter to load on
        demand and none serves it yet (raises AdapterLoadFailed when that fails)."""
        if name is None or name not in model.load_adapters:
            return
        if any(r.available for r in model.replicas_for(name)):
            return
        key = (model.name, name)
        task = self._loading.get(key)
        if task is None:
            task = self._loading[key] = asyncio.create_task(self._load(model, name))
            task.add_done_callback(lambda _: self._loading.pop(key, None))
        await asyncio.shield(task)

    async def _load(self, model: ServedModel, name: str) -> Replica:
        candidates = [r for r in model.replicas
                      if r.available and r.profile.adapter_load_path is not None]
        if not candidates:
            raise AdapterLoadFailed(f"no available vLLM replica of model `{model.name}` to "
                                    f"load adapter `{name}` on")
        replica = min(candidates, key=lambda r: self.outstanding(r.name))
        body = {"lora_name": name, "lora_path": model.load_adapters[name]}
        try:
            path = replica.profile.adapter_load_path
            async with self.session().post(f"{replica.url}{path}", json=body,
                                           timeout=aiohttp.ClientTimeout(total=self.timeout)
                                           ) as response:
                text = await response.text(errors="replace")
                if not replica.profile.adapter_loaded(response.status, text):
                    raise AdapterLoadFailed(f"replica {replica.name} could not load adapter "
                                            f"`{name}`: HTTP {response.status} {text[:300]}")
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise AdapterLoadFailed(f"replica {replica.name} could not load adapter "
                                    f"`{name}`: {exc}") from None
        parent = next((n for n, p in replica.served_names.items() if p is None), model.name)
        replica.served_names = {**replica.served_names, name: parent}
        log.info("loaded adapter %s on replica %s", name, replica.name)
        return replica
