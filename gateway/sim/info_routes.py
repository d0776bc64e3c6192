"""The simulated engines' introspection routes, each dialect's own: vLLM's ``/version``,
``/tokenize``, ``/detokenize``; SGLang's ``/server_info``, ``/model_info``; llama.cpp's
``/props``, ``/tokenize``. A mixin of ``gateway.sim.app.SimApp``."""

from __future__ import annotations

from typing import Any

from gateway.sim.asgi import Request, respond_json
from gateway.sim.dialects import ClientError
from gateway.sim.parse import chat_ids, load_json
from gateway.sim.sim_config import VERSION, SimConfig


class InfoRoutes:
    cfg: SimConfig
    dialect: Any

    async def vllm_tokenize(self, req: Request) -> None:
        body = load_json(req.body, self.dialect)
        tok = self.cfg.tokenizer
        if "messages" in body:
            ids = chat_ids(body, tok, self.dialect)
        else:
            if not isinstance(body.get("prompt"), str):
                raise ClientError("1 validation error:\n  {'loc': ('body', 'prompt'), 'msg': 'Field required'}",
                                  "schema", "prompt")
            add = body.get("add_special_tokens", True)
            ids = tok.encode(body["prompt"], add_special_tokens=add is not False)
        await respond_json(req.send, 200, {"count": len(ids), "max_model_len": self.cfg.max_model_len,
                                           "tokens": ids})

    async def vllm_detokenize(self, req: Request) -> None:
        body = load_json(req.body, self.dialect)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise ClientError("1 validation error:\n  {'loc': ('body', 'tokens'), 'msg': 'Input should be a "
                              "valid list of integers'}", "schema", "tokens")
        await respond_json(req.send, 200, {"prompt": self.cfg.tokenizer.decode(tokens)})

    async def llamacpp_tokenize(self, req: Request) -> None:
        body = load_json(req.body, self.dialect)
        content = body.get("content")
        if not isinstance(content, str):
            raise ClientError("\"content\" must be provided", "invalid")
        ids = self.cfg.tokenizer.encode(content, add_special_tokens=body.get("add_special") is True)
        await respond_json(req.send, 200, {"tokens": ids})

    async def version(self, req: Request) -> None:
        await respond_json(req.send, 200, {"version": VERSION["vllm"]})

    async def server_info(self, req: Request) -> None:
        cfg = self.cfg
        await respond_json(req.send, 200, {
            "model_path": cfg.model, "tokenizer_path": cfg.tokenizer_dir, "served_model_name": cfg.model,
            "context_length": cfg.max_model_len, "max_running_requests": cfg.profile.max_running_seqs,
            "max_total_num_tokens": min(cfg.profile.kv_capacity_tokens, 2**31 - 1),
            "chunked_prefill_size": cfg.profile.max_batched_tokens, "version": VERSION["sglang"]})

    async def model_info(self, req: Request) -> None:
        await respond_json(req.send, 200, {"model_path": self.cfg.model, "tokenizer_path": self.cfg.tokenizer_dir,
                                           "is_generation": True})

    async def props(self, req: Request) -> None:
        cfg = self.cfg
        await respond_json(req.send, 200, {
            "default_generation_settings": {"params": {"n_predict": -1, "seed": -1},
                                            "n_ctx": cfg.max_model_len},
            "total_slots": cfg.profile.max_running_seqs, "model_path": cfg.model,
            "chat_template": cfg.tokenizer.chat_template or "", "build_info": VERSION["llamacpp"]})
