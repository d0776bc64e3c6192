"""The simulated TGI's own routes: ``/generate``, ``/generate_stream``, ``POST /`` (TGI's
compat route), ``/info`` and ``/tokenize``, over the replica's shared generation path
(``SimApp.run``). A mixin of ``gateway.sim.app.SimApp``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import orjson

from gateway.sim.asgi import Request, respond_json, start_stream, write
from gateway.sim.dialects import TGI, ClientError
from gateway.sim.parse import Limits, load_json, tgi_job
from gateway.sim.scheduler import Sequence
from gateway.sim.wire import Vocab
from gateway.sim.wire_tgi import TGIStream, tgi_output

if TYPE_CHECKING:
    from gateway.sim.sim_config import SimConfig

FAILURE_LABEL = {"overloaded": "overloaded", "injected": "generation"}  # tgi_request_failure{err}


def tgi_version(version: str) -> tuple[int, ...]:
    """``"2.3.1"`` (or ``"3.0.0-rc1"``) as (2, 3, 1), to compare."""
    parts = [int(p) for p in version.split("-")[0].split(".")[:3] if p.isdigit()]
    return tuple(parts + [0] * (3 - len(parts)))


class TgiRoutes:
    cfg: "SimConfig"
    dialect: Any
    limits: Limits
    vocab: Vocab
    meter: Any
    in_flight: int
    run: Any

    async def generate(self, req: Request) -> None:
        await self._tgi(req, stream=False)

    async def generate_stream(self, req: Request) -> None:
        await self._tgi(req, stream=True)

    async def compat_generate(self, req: Request) -> None:
        await self._tgi(req, stream=None)

    async def _tgi(self, req: Request, stream: bool | None) -> None:
        d = self.dialect
        assert isinstance(d, TGI)
        body = load_json(req.body, d)
        streaming = stream if stream is not None else body.get("stream") is True
        compat = stream is None
        try:
            job = tgi_job(body, self.cfg.tokenizer, d, self.limits, streaming, compat=compat)
            if streaming:
                self._check_overload()
        except ClientError as err:
            if not streaming or err.kind == "schema":
                raise
            self.meter.failure(FAILURE_LABEL.get(err.kind, "validation"))
            await start_stream(req.send, [(b"x-compute-type", b"gpu+optimized")])
            await write(req.send, d.stream_error_event(err), more=False)  # TGI: errors inside HTTP 200
            return
        # details.input_length came with TGI 2.3
        events = TGIStream(job, self.vocab, tgi_version(self.cfg.tgi_version) >= (2, 3, 0), d.data_prefix)

        def body_of(pieces: list[int], seq: Sequence) -> bytes:
            out = tgi_output(job, self.vocab)
            return orjson.dumps([out] if compat else out)

        await self.run(req, job, events, body_of, self._tgi_headers)

    def _check_overload(self) -> None:
        if self.in_flight >= self.cfg.max_concurrent_requests:
            raise ClientError("Model is overloaded", "overloaded")

    def _tgi_headers(self, seq: Sequence) -> list[tuple[bytes, bytes]]:
        ms = lambda seconds: b"%d" % int(max(0.0, seconds) * 1000)  # noqa: E731
        end = seq.last_token_at or seq.arrived
        queue = (seq.admitted_at or seq.arrived) - seq.arrived
        total = end - seq.arrived
        return [(b"x-compute-type", b"gpu+optimized"), (b"x-compute-time", ms(total)),
                (b"x-total-time", ms(total)), (b"x-validation-time", b"0"), (b"x-queue-time", ms(queue)),
                (b"x-inference-time", ms(total - queue)),
                (b"x-time-per-token", ms((total - queue) / max(1, seq.generated))),
                (b"x-prompt-tokens", b"%d" % seq.prompt_tokens), (b"x-generated-tokens", b"%d" % seq.generated)]

    async def info(self, req: Request) -> None:
        p, cfg = self.cfg.profile, self.cfg
        await respond_json(req.send, 200, {
            "model_id": cfg.model, "model_sha": None, "model_dtype": "torch.bfloat16",
            "model_device_type": "cuda", "model_pipeline_tag": "text-generation",
            "max_concurrent_requests": cfg.max_concurrent_requests, "max_best_of": 2, "max_stop_sequences": 4,
            "max_input_tokens": self.limits.max_input_tokens, "max_total_tokens": cfg.max_model_len,
            "waiting_served_ratio": 0.3, "max_batch_total_tokens": min(p.kv_capacity_tokens, 2**31 - 1),
            "max_waiting_tokens": 20, "max_batch_size": p.max_running_seqs, "validation_workers": 2,
            "max_client_batch_size": 4, "router": "text-generation-router", "version": cfg.tgi_version,
            "sha": None, "docker_label": None})

    async def tgi_tokenize(self, req: Request) -> None:
        body = load_json(req.body, self.dialect)
        inputs = body.get("inputs")
        if not isinstance(inputs, str):
            raise ClientError("Failed to deserialize the JSON body into the target type: missing field `inputs`",
                              "schema")
        enc = self.cfg.tokenizer.tokenizer.encode(inputs, add_special_tokens=True)
        await respond_json(req.send, 200, [{"id": i, "text": inputs[a:b], "start": a, "stop": b}
                                           for i, (a, b) in zip(enc.ids, enc.offsets)])
