"""The names one simulated vLLM answers to: its model, more served names (vLLM's
``--served-model-name a b``) and LoRA adapters (``--lora-modules NAME=PATH``, or loaded at
run time with ``POST /v1/load_lora_adapter`` when allowed), as vLLM shows them:

- ``/v1/models`` lists each adapter with ``root`` its path and ``parent`` the base model;
- ``vllm:lora_requests_info{max_lora, running_lora_adapters, waiting_lora_adapters}`` says
  which adapters have requests running and waiting (comma-joined names; the value is the
  time it was set, as vLLM's gauge);
- an adapter's answers differ from the base model's (another text seed).

The adapters with requests in flight take the ``max_loras`` slots in arrival order; the rest
count as waiting (the simulated engine itself does not hold them back).
"""

from __future__ import annotations

import time
import zlib
from collections import Counter
from typing import Any, Iterator


class SimNames:
    def __init__(self, model: str, aliases: list[str] | None = None,
                 adapters: dict[str, str] | None = None, max_loras: int = 1,
                 runtime_updates: bool = False) -> None:
        self.model = model
        self.aliases = list(aliases or ())
        self.adapters = dict(adapters or {})
        self.max_loras = max_loras
        self.runtime_updates = runtime_updates
        self.in_flight: Counter[str] = Counter()  # adapter -> requests in flight (ordered)

    @property
    def lora_enabled(self) -> bool:
        return bool(self.adapters) or self.runtime_updates

    def serves(self, name: str) -> bool:
        return name == self.model or name in self.aliases or name in self.adapters

    def text_seed(self, name: str | None, seed: int) -> int:
        """The base model's seed for its names; another for each adapter."""
        if name in self.adapters:
            return seed + zlib.crc32(name.encode())
        return seed

    def cards(self, base_card: Any) -> list[dict[str, Any]]:
        """/v1/models: the served names (as the base card), then the adapters."""
        cards = [base_card(name) for name in (self.model, *self.aliases)]
        for name, path in self.adapters.items():
            card = dict(base_card(name))
            card.update(root=path, parent=self.model, max_model_len=None)
            cards.append(card)
        return cards

    def begin(self, name: str | None) -> None:
        if name in self.adapters:
            self.in_flight[name] += 1

    def end(self, name: str | None) -> None:
        if name in self.adapters:
            self.in_flight[name] -= 1
            if self.in_flight[name] <= 0:
                del self.in_flight[name]

    def lora_info(self) -> Iterator[tuple[dict[str, str], float]]:
        """One sample of ``vllm:lora_requests_info`` (none without LoRA)."""
        if not self.lora_enabled:
            return
        active = list(self.in_flight)
        running, waiting = active[:self.max_loras], active[self.max_loras:]
        yield ({"max_lora": str(self.max_loras), "running_lora_adapters": ",".join(running),
                "waiting_lora_adapters": ",".join(waiting)}, time.time())

    def load(self, body: dict[str, Any]) -> tuple[int, str | None]:
        """POST /v1/load_lora_adapter: (status, error message or None on success)."""
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            return 400, "Both 'lora_name' and 'lora_path' must be provided."
        if name in self.adapters:
            return 400, (f"The lora adapter '{name}' has already been loaded. If you want to "
                         "load the adapter in place, set 'load_inplace' to True.")
        self.adapters[name] = path
        return 200, None

    def unload(self, body: dict[str, Any]) -> tuple[int, str | None]:
        name = body.get("lora_name")
        if not isinstance(name, str) or name not in self.adapters:
            return 404, f"The lora adapter '{name}' cannot be found."
        del self.adapters[name]
        return 200, None
