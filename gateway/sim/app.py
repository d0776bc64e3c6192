"""The simulated replica as an ASGI app: routes per dialect over one shared generation path.

Every generation route does the same thing: parse into a ``Job`` (exact prompt tokens),
maybe inject a fault, submit a ``Sequence`` to the engine, then either wait for it and answer
once, or stream its tokens as they become visible. A client that goes away aborts the sequence
at once (slot and KV freed), so no work is orphaned.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import replace
from typing import Any, Awaitable, Callable

import orjson
import zmq

from gateway.sim import textgen
from gateway.sim.asgi import (DropConnection, Request, read_body, respond, respond_json, start_stream,
                              wait_disconnect, watch_disconnect, write)
from gateway.sim.dialects import TGI, ClientError, Dialect, make_dialect
from gateway.sim.engine import make_engine
from gateway.sim.scheduler import Sequence, block_hashes
from gateway.sim.faults import FaultError
from gateway.sim.kv_publisher import KvEventPublisher
from gateway.sim import messages as messages_api
from gateway.sim.lora import SimNames
from gateway.sim.messages import MessageEvents
from gateway.sim.metrics import make_meter, render
from gateway.sim.pooling import PoolingRoutes
from gateway.sim.responses import SimResponses
from gateway.sim.parse import Job, Limits, load_json, openai_job
from gateway.sim.info_routes import InfoRoutes
from gateway.sim.tgi_routes import FAILURE_LABEL, TgiRoutes, tgi_version
from gateway.sim.wire_tgi import TGIStream
from gateway.sim.wire import OpenAIStream, Vocab, openai_body
from gateway.sim.wire_llamacpp import LlamaCppStream, llamacpp_body
from gateway.sim.sim_config import SimConfig

Handler = Callable[[Request], Awaitable[None]]


class SimApp(TgiRoutes, InfoRoutes):
    """One replica. ``await app(scope, receive, send)`` is the ASGI entry point."""

    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        old_sse = cfg.dialect == "tgi" and tgi_version(cfg.tgi_version) < (2, 1, 0)  # axum 0.6: `data:{`
        self.dialect: Dialect = make_dialect(cfg.dialect, cfg.vllm_flat_errors, cfg.tgi_sse_no_space or old_sse)
        self.faults = cfg.faults
        self.meter = make_meter(cfg.dialect, cfg.max_model_len)
        self.kv_publisher = (KvEventPublisher(cfg.kv_events, cfg.faults)
                             if cfg.kv_events is not None else None)
        self.engine = make_engine(cfg.profile, self.meter, cfg.faults, cfg.speed, cfg.prefix_cache,
                                  self.kv_publisher)
        self.names = SimNames(cfg.model, cfg.aliases, cfg.lora_modules, cfg.max_loras,
                              cfg.runtime_lora)
        self.piece_ids = textgen.PieceIds(lambda s: cfg.tokenizer.encode(s, add_special_tokens=False)).ids
        self.limits = Limits(cfg.model, cfg.max_model_len, cfg.profile.mean_output_tokens,
                             cfg.max_input_tokens or cfg.max_model_len - 1,
                             eos_before_max=cfg.eos_before_max, text_seed=cfg.text_seed,
                             names=self.names, piece_bytes=textgen.id_bytes(self.piece_ids))
        eos_text = cfg.tokenizer.special_tokens.get("eos_token") or "</s>"
        eos_id = (cfg.tokenizer.tokenizer.token_to_id(eos_text) or 0) if eos_text else 0
        self.vocab = Vocab(self.piece_ids, eos_id, eos_text, cfg.tokenizer.decode)
        self.created = int(time.time())
        self.in_flight = 0
        self.routes: dict[tuple[str, str], Handler] = {
            ("GET", "/health"): self.health,
            ("GET", "/metrics"): self.metrics,
            ("GET", "/v1/models"): self.models,
            ("GET", "/sim/state"): self.sim_state,
            ("GET", "/sim/faults"): self.get_faults,
            ("POST", "/sim/faults"): self.set_faults,
            ("POST", "/v1/completions"): self.completions,
            ("POST", "/v1/chat/completions"): self.chat_completions,
        }
        extra: dict[str, dict[tuple[str, str], Handler]] = {
            "vllm": {("GET", "/version"): self.version, ("POST", "/tokenize"): self.vllm_tokenize,
                     ("POST", "/detokenize"): self.vllm_detokenize, ("GET", "/ping"): self.health,
                     ("POST", "/ping"): self.health},
            "sglang": {("GET", "/server_info"): self.server_info, ("GET", "/get_server_info"): self.server_info,
                       ("GET", "/model_info"): self.model_info, ("GET", "/get_model_info"): self.model_info,
                       ("GET", "/health_generate"): self.health},
            "llamacpp": {("GET", "/props"): self.props, ("GET", "/models"): self.models,
                         ("POST", "/tokenize"): self.llamacpp_tokenize},
            "tgi": {("POST", "/generate"): self.generate, ("POST", "/generate_stream"): self.generate_stream,
                    ("POST", "/"): self.compat_generate, ("GET", "/info"): self.info,
                    ("POST", "/tokenize"): self.tgi_tokenize, ("GET", "/ping"): self.health},
            "lmdeploy": {},  # its OpenAI routes, /health and /metrics are the shared ones
        }
        self.routes.update(extra[cfg.dialect])
        if cfg.dialect == "vllm" and cfg.runner == "pooling":  # vLLM: no generation routes
            self.pooling = PoolingRoutes(cfg.model, cfg.max_model_len, cfg.tokenizer)
            del self.routes[("POST", "/v1/completions")], self.routes[("POST", "/v1/chat/completions")]
            for path in self.pooling.routes:
                self.routes[("POST", path)] = self.pool
        if cfg.dialect == "vllm" and cfg.runner == "generate":
            self.responses = SimResponses(cfg.model, cfg.tokenizer)
            self.routes[("POST", "/v1/responses")] = self.create_response
        if cfg.dialect == "llamacpp" or cfg.dialect == "vllm" and cfg.runner == "generate":
            self.routes[("POST", "/v1/messages")] = self.messages  # Anthropic's API
        if cfg.dialect == "vllm" and cfg.runtime_lora:  # VLLM_ALLOW_RUNTIME_LORA_UPDATING
            self.routes[("POST", "/v1/load_lora_adapter")] = self.load_lora_adapter
            self.routes[("POST", "/v1/unload_lora_adapter")] = self.unload_lora_adapter
        if cfg.dialect == "tgi":  # what older TGI versions did not have yet
            version = tgi_version(cfg.tgi_version)
            if version < (1, 4, 4):
                del self.routes[("POST", "/v1/completions")]
            if version < (1, 4, 0):
                del self.routes[("POST", "/v1/chat/completions")]
        self.paths = {path for _, path in self.routes}

    # --- ASGI ---

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            handler = self.routes.get((scope["method"], scope["path"]))
            if (handler is None and scope["method"] == "GET" and self.cfg.runner == "generate"
                    and scope["path"].startswith("/v1/responses/") and self.cfg.dialect == "vllm"):
                response_id = scope["path"].removeprefix("/v1/responses/")
                handler = lambda req: self.get_response(req, response_id)  # noqa: E731
            try:
                body = await read_body(receive)
            except ConnectionAbortedError:
                return
            req = Request(scope, receive, send, body)
            if handler is None:
                err = self.dialect.not_found_route() if scope["path"] not in self.paths else \
                    ClientError("Method Not Allowed", "invalid", status=405)
                await self.error(req, err)
                return
            try:
                await handler(req)
            except ClientError as err:
                await self.error(req, err)
        elif scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    if self.kv_publisher is not None:
                        try:
                            self.kv_publisher.start()
                        except zmq.ZMQError as exc:  # its port is taken
                            await send({"type": "lifespan.startup.failed",
                                        "message": f"KV events: {exc}"})
                            return
                    self.engine.start()
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await self.engine.stop()
                    if self.kv_publisher is not None:
                        await self.kv_publisher.stop()
                    await send({"type": "lifespan.shutdown.complete"})
                    return

    async def error(self, req: Request, err: ClientError) -> None:
        status, body = self.dialect.error_body(err)
        if err.kind not in ("not_found",) and status != 405:
            self.meter.failure(FAILURE_LABEL.get(err.kind, "validation"))
        await respond_json(req.send, status, body)

    # --- the shared generation path ---

    def _admit(self) -> None:
        if isinstance(self.dialect, TGI) and self.in_flight >= self.cfg.max_concurrent_requests:
            raise ClientError("Model is overloaded", "overloaded")
        if self.faults.should_fail():
            self.meter.errors_injected += 1
            raise ClientError("Simulated engine failure (injected fault)", "injected",
                              status=self.faults.error_status)

    async def run(self, req: Request, job: Job, stream: Any, body: Callable[[list[int], Sequence], bytes],
                  headers: Callable[[Sequence], list[tuple[bytes, bytes]]] | None = None) -> None:
        """Generate ``job`` and answer: streamed through ``stream`` or as ``body(pieces, seq)``."""
        self._admit()
        engine = self.engine
        hashes = (block_hashes(job.prompt_ids, self.cfg.profile.block_size, job.lora_name,
                               job.cache_salt) if self.cfg.prefix_cache else ())
        seq = Sequence(job.prompt_tokens, job.max_new, job.finish_reason, hashes,
                       tuple(job.prompt_ids) if self.kv_publisher is not None else (),
                       job.lora_name, job.cache_salt, external_tokens=job.external_tokens)
        pieces = job.choices[0].pieces  # streams: one choice
        self.meter.requests_received += 1
        self.in_flight += 1
        if job.transfer_s:  # a disaggregated decode loads the prompt's KV first
            await asyncio.sleep(job.transfer_s / self.cfg.speed)
        engine.submit(seq)
        watcher = watch_disconnect(req.receive, lambda: engine.abort(seq)) if engine.delays else None
        try:
            if job.stream:
                await self._stream(req, seq, pieces, stream, headers(seq) if headers else None, watcher)
                return
            while not seq.done:
                await engine.wait(seq, seq.visible)
            if seq.aborted:
                return
            if self.faults.stall_after is not None:
                await (watcher if watcher else wait_disconnect(req.receive))
                return
            if self.faults.drop_after is not None:
                raise DropConnection
            await respond(req.send, 200, body(pieces, seq), headers=headers(seq) if headers else None)
        finally:
            self.in_flight -= 1
            if watcher is not None:
                watcher.cancel()
            if not seq.done:
                engine.abort(seq)

    async def _stream(self, req: Request, seq: Sequence, pieces: list[int], events: Any,
                      headers: list[tuple[bytes, bytes]] | None, watcher: asyncio.Task | None) -> None:
        send, engine, n = req.send, self.engine, seq.max_new_tokens
        broken = self.faults.stream_break(n)
        await start_stream(send, headers)
        out, seen = [events.open()], 0
        while True:
            visible = await engine.wait(seq, seen)
            if seq.aborted:
                return
            upto = min(visible, n if broken is None else broken.at)
            if upto > seen:
                out.append(events.tokens(seen, pieces[seen:upto]))
                seen = upto
            if broken is not None and seen >= broken.at and (seen < n or broken.at_end):
                await self._write(send, b"".join(out))
                await self._break(req, broken.kind, events, watcher)
                return
            if seen >= n:
                out.append(events.close(seen))
                await self._write(send, b"".join(out), more=False)
                return
            await self._write(send, b"".join(out))
            out = []

    async def _break(self, req: Request, kind: str, events: Any,
                     watcher: asyncio.Task | None) -> None:
        """A stream's injected fault: the connection dropped, the stream stalled (kept open
        until the client leaves), or an error event as the engine sends one mid-stream."""
        if kind == "drop":
            raise DropConnection
        if kind == "stall":
            await (watcher if watcher else wait_disconnect(req.receive))
            return
        err = ClientError("Simulated engine failure mid-stream (injected fault)", "injected",
                          status=500)
        done = b"" if isinstance(events, TGIStream) else self.dialect.data_prefix + b"[DONE]\n\n"
        await write(req.send, self.dialect.stream_error_event(err) + done, more=False)

    async def _write(self, send: Any, data: bytes, more: bool = True) -> None:
        """Stream bytes: all that is ready in one write (default), or, with ``event_writes``,
        each SSE event in a write of its own, ``event_gap_s`` apart, as vLLM's server sends
        them (its usage chunk and ``[DONE]`` leave after the last token, separately)."""
        if not self.cfg.event_writes:
            await write(send, data, more)
            return
        *whole, tail = data.split(b"\n\n")
        events = [event + b"\n\n" for event in whole] + ([tail] if tail or not whole else [])
        for i, event in enumerate(events):
            if i:
                await asyncio.sleep(self.cfg.event_gap_s)
            await write(send, event, more or i < len(events) - 1)

    # --- OpenAI routes (vllm, sglang, llamacpp, and TGI's messages API) ---

    async def completions(self, req: Request) -> None:
        await self._openai(req, chat=False)

    async def chat_completions(self, req: Request) -> None:
        await self._openai(req, chat=True)

    async def _openai(self, req: Request, chat: bool) -> None:
        d, cfg = self.dialect, self.cfg
        try:
            body = load_json(req.body, d)
            name = body.get("model") if isinstance(body.get("model"), str) else None
            limits = self.limits
            if name in self.names.adapters:  # an adapter answers otherwise than its base
                limits = replace(limits, text_seed=self.names.text_seed(name, limits.text_seed))
            job = openai_job(body, chat, cfg.tokenizer, d, limits)
        except ClientError as err:
            if isinstance(d, TGI) and isinstance(req_body_stream(req.body), bool) and req_body_stream(req.body):
                self.meter.failure("validation")
                await start_stream(req.send)
                await write(req.send, d.chat_stream_error_event(err), more=False)
                return
            raise
        # vLLM answers an alias under its first served name, an adapter under its own.
        model = cfg.model if name is None or name in self.names.aliases else name
        include_usage = job.include_usage and not cfg.no_stream_usage
        if d.name == "llamacpp":  # its own field order and end of stream
            await self.run(req, job, LlamaCppStream(chat, model, job, self.vocab, include_usage, d.data_prefix),
                           lambda pieces, seq: llamacpp_body(chat, model, job, self.vocab))
            return
        events = OpenAIStream(d.name, chat, model, job, self.vocab, include_usage,
                              job.continuous_usage and not cfg.no_stream_usage, d.data_prefix,
                              interval=max(cfg.stream_interval, job.extras.stream_interval)
                              if d.name == "vllm" else 1)
        handoff = self._kv_transfer(req, body, job)
        self.names.begin(name)
        try:
            await self.run(req, job, events,
                           lambda pieces, seq: openai_body(d.name, chat, model, job, self.vocab,
                                                           handoff(seq)))
        finally:
            self.names.end(name)

    async def messages(self, req: Request) -> None:
        """Anthropic's Messages API: the chat it asks for, in Anthropic's events."""
        chat = messages_api.chat_request(load_json(req.body, self.dialect))
        name = chat.get("model")
        job = openai_job(chat, True, self.cfg.tokenizer, self.dialect, self.limits)
        model = self.cfg.model if name is None or name in self.names.aliases else name
        await self.run(req, job, MessageEvents(model, job),
                       lambda pieces, seq: messages_api.message_body(model, job))

    def _kv_transfer(self, req: Request, body: dict[str, Any], job: Job
                     ) -> Callable[[Sequence], dict[str, Any] | None]:
        """Disaggregated prefill (``kv_connector``): a decode request's KV is loaded (set on
        ``job``); what a prefill's answer says of its KV, once it has ended."""
        connector = self.cfg.kv_connector
        if connector is None or self.cfg.dialect != "vllm":
            return lambda seq: None
        params = body.get("kv_transfer_params")
        job.external_tokens, job.transfer_s = connector.remote_prefill(params, job.prompt_tokens)
        if not connector.remote_decode(params):
            return lambda seq: None
        request_id = dict(req.scope["headers"]).get(b"x-request-id", b"").decode("latin-1") \
            or f"cmpl-{uuid.uuid4().hex}"
        return lambda seq: (connector.handoff(request_id, job.prompt_tokens)
                            if seq.finish_reason == "length" else None)

    async def models(self, req: Request) -> None:
        cards = self.names.cards(
            lambda name: self.dialect.model_card(name, self.cfg.max_model_len, self.created))
        await respond_json(req.send, 200, {"object": "list", "data": cards})

    async def create_response(self, req: Request) -> None:
        body = load_json(req.body, self.dialect)
        model = body.get("model")
        if model is not None and not self.limits.serves(model):
            raise self.dialect.unknown_model(model)
        response = self.responses.create(body)
        if body.get("stream") is True:
            await start_stream(req.send)
            await write(req.send, self.responses.events(response), more=False)
            return
        await respond_json(req.send, 200, response)

    async def get_response(self, req: Request, response_id: str) -> None:
        await respond_json(req.send, 200, self.responses.get(response_id))

    async def pool(self, req: Request) -> None:
        body = load_json(req.body, self.dialect)
        model = body.get("model")
        if model is not None and not self.limits.serves(model):
            raise self.dialect.unknown_model(model)
        await respond_json(req.send, 200, self.pooling.routes[req.path](body))

    async def load_lora_adapter(self, req: Request) -> None:
        await self._lora_update(req, self.names.load, "added")

    async def unload_lora_adapter(self, req: Request) -> None:
        await self._lora_update(req, self.names.unload, "removed")

    async def _lora_update(self, req: Request, update: Callable[[dict[str, Any]], tuple[int, str | None]],
                           done: str) -> None:
        """vLLM answers success in plain text, failures as its error JSON."""
        body = load_json(req.body, self.dialect)
        status, message = update(body)
        if message is not None:
            raise ClientError(message, "invalid" if status == 400 else "not_found", status=status)
        await respond(req.send, 200, f"Success: LoRA adapter '{body['lora_name']}' {done} "
                      "successfully.".encode(), b"text/plain; charset=utf-8")

    # --- TGI routes ---

    # --- probes, metrics, simulator control ---

    async def health(self, req: Request) -> None:
        status, body, ctype = self.dialect.health(not self.faults.fail_health)
        await respond(req.send, status, body, ctype)

    async def metrics(self, req: Request) -> None:
        text = render(self.cfg.dialect, self.meter, self.engine.gauges(), self.cfg.model,
                      self.names.lora_info())
        await respond(req.send, 200, text, b"text/plain; version=0.0.4; charset=utf-8")

    async def sim_state(self, req: Request) -> None:
        m = self.meter
        await respond_json(req.send, 200, {
            **self.engine.state(), "in_flight": self.in_flight, "errors_injected_total": m.errors_injected,
            "prompt_tokens_total": m.prompt_tokens, "generation_tokens_total": m.generation_tokens,
            "preemptions_total": m.preemptions, "prefix_cache_hit_tokens": m.prefix_hits,
            "ttft_count": m.ttft.count, "ttft_sum_s": m.ttft.sum,
            "dialect": self.cfg.dialect, "profile": self.cfg.profile.name, "speed": self.cfg.speed,
            "faults": self.faults.as_dict(),
            "kv_events": self.kv_publisher.state() if self.kv_publisher is not None else None,
            "kv_connector": (self.cfg.kv_connector.state() if self.cfg.kv_connector is not None
                             else None)})

    async def get_faults(self, req: Request) -> None:
        await respond_json(req.send, 200, self.faults.as_dict())

    async def set_faults(self, req: Request) -> None:
        try:
            self.faults.update(orjson.loads(req.body or b"{}"))
        except (FaultError, orjson.JSONDecodeError) as exc:
            await respond_json(req.send, 400, {"error": str(exc)})
            return
        await respond_json(req.send, 200, self.faults.as_dict())


def req_body_stream(body: bytes) -> Any:
    """The ``stream`` flag of a body that may not parse (for TGI's in-stream errors)."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    return data.get("stream") if isinstance(data, dict) else None
