"""Disaggregated prefill in the simulator: vLLM's ``NixlConnector`` as a client of the engine
sees it (``--role prefill|decode|both``, vLLM's ``kv_role`` kv_producer, kv_consumer,
kv_both), from vLLM 0.32's ``nixl_connector.py``:

- a request whose ``kv_transfer_params`` has ``do_remote_decode`` (a prefill engine's) is
  served as usual; if it ends by its length cap (the one token a proxy asks for) its
  answer's ``kv_transfer_params`` say where its KV blocks wait: ``do_remote_prefill`` true,
  ``remote_block_ids``, ``remote_engine_id``, ``remote_request_id``, ``remote_host``,
  ``remote_port``, ``tp_size``. One that ends otherwise (a stop) gives none
  (``request_finished``: only ``FINISHED_LENGTH_CAPPED`` hands blocks over);
- a request whose ``kv_transfer_params`` has ``do_remote_prefill`` and every remote field (a
  decode engine's) loads the prompt's KV from there instead of computing it: here, a delay of
  ``transfer_s_per_block`` per block before it joins the batch, then all but the last prompt
  token count as computed. Fields missing: vLLM warns and prefills locally, as here.

What the real connector does that this does not: hold the prefill's blocks until the decode
engine has read them (``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``), check the pair's compatibility,
and fail a transfer from an engine that is gone (the decode engine then recomputes).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

ROLES = ("prefill", "decode", "both")
REMOTE_FIELDS = ("remote_block_ids", "remote_engine_id", "remote_request_id", "remote_host",
                 "remote_port")


@dataclass
class KvConnector:
    role: str  # prefill (kv_producer), decode (kv_consumer) or both (kv_both)
    block_size: int
    transfer_s_per_block: float = 0.0
    host: str = "127.0.0.1"
    port: int = 5600  # the side channel (VLLM_NIXL_SIDE_CHANNEL_PORT)
    engine_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    sent: int = 0  # prefills whose blocks were handed over
    received: int = 0  # decodes that loaded their prompt's KV
    received_tokens: int = 0
    refused: int = 0  # do_remote_prefill with fields missing: prefilled here

    def remote_decode(self, params: Any) -> bool:
        """The request is a prefill for another engine."""
        return (self.role != "decode" and isinstance(params, dict)
                and bool(params.get("do_remote_decode")))

    def handoff(self, request_id: str, prompt_tokens: int) -> dict[str, Any]:
        """The answer's ``kv_transfer_params`` of a length-capped prefill."""
        self.sent += 1
        blocks = -(-prompt_tokens // self.block_size)
        # One list of block ids per KV-cache group (a plain model has one), as vLLM 0.32's
        # NixlConnector answered on the CPU build: "remote_block_ids": [[1, 2, 3]].
        return {"do_remote_prefill": True, "do_remote_decode": False,
                "remote_block_ids": [list(range(blocks))], "remote_engine_id": self.engine_id,
                "remote_request_id": request_id, "remote_host": self.host,
                "remote_port": self.port, "tp_size": 1}

    def remote_prefill(self, params: Any, prompt_tokens: int) -> tuple[int, float]:
        """(prompt tokens loaded from the prefill engine, seconds the transfer takes); (0, 0)
        when the request is to be prefilled here."""
        if self.role == "prefill" or not isinstance(params, dict) \
                or not params.get("do_remote_prefill"):
            return 0, 0.0
        if not params.get("remote_block_ids") or not all(f in params for f in REMOTE_FIELDS):
            self.refused += 1  # "Got invalid KVTransferParams ... will not utilize KVTransfer"
            return 0, 0.0
        self.received += 1
        self.received_tokens += prompt_tokens
        blocks = -(-prompt_tokens // self.block_size)
        return prompt_tokens, blocks * self.transfer_s_per_block

    def state(self) -> dict[str, Any]:
        return {"role": self.role, "engine_id": self.engine_id, "sent": self.sent,
                "received": self.received, "received_tokens": self.received_tokens,
                "refused": self.refused}
