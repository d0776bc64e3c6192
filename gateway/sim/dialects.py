"""What differs between engines on the wire: error envelopes, context-window checks and their
wording, health answers and model cards. Routes (``app.py``) are shared; they ask the dialect.

Error wording is copied from the engines' sources (see ENGINE-WIRE.md):
- vLLM: 0.15.1 wording with the ``(parameter=..., value=...)`` suffix and the nested body;
  ``--vllm-flat-errors`` emulates vLLM <= 0.10.0 (flat body and the old wording).
- SGLang 0.5: flat body, ``The input (...) is longer than ...`` (rejects prompt >= L and
  prompt + max_tokens >= L, as its tokenizer manager does).
- llama.cpp: ``exceed_context_size_error`` (prompt-only: prompt >= n_ctx); any model name accepted.
- TGI: ``{"error","error_type"}``; validation is 422.
"""

from __future__ import annotations

from typing import Any

import orjson


class ClientError(Exception):
    """A request the engine refuses. ``kind`` picks status and envelope in each dialect:
    schema (wrong JSON/types), invalid (bad value), context, not_found, overloaded, injected."""

    def __init__(self, message: str, kind: str = "invalid", param: str | None = None,
                 status: int | None = None, extra: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.message, self.kind, self.param, self.status, self.extra = message, kind, param, status, extra


class Dialect:
    """vLLM (newest shapes); the others override what differs."""

    name = "vllm"
    owned_by = "vllm"
    checks_model_name = True  # 404 for a model it does not serve
    completions_default_max_tokens: int | None = 16
    data_prefix = b"data: "

    def __init__(self, flat_errors: bool = False) -> None:
        self.flat_errors = flat_errors

    # --- errors ---

    def status(self, err: ClientError) -> int:
        if err.status:
            return err.status
        return {"not_found": 404, "overloaded": 429}.get(err.kind, 400)

    def error_type(self, err: ClientError, status: int) -> str:
        if err.kind == "schema" and not self.flat_errors:
            return "Bad Request"
        return {400: "BadRequestError", 404: "NotFoundError", 429: "TooManyRequestsError",
                500: "InternalServerError", 503: "ServiceUnavailableError"}.get(status, "Error")

    def error_body(self, err: ClientError) -> tuple[int, Any]:
        status = self.status(err)
        info = {"message": err.message, "type": self.error_type(err, status), "param": err.param, "code": status}
        if self.flat_errors:
            return status, {"object": "error", **info}
        return status, {"error": info}

    def stream_error_event(self, err: ClientError) -> bytes:
        status, body = self.error_body(err)
        if "error" not in body:
            body = {"error": body}
        return self.data_prefix + orjson.dumps(body) + b"\n\n"

    def unknown_model(self, model: str) -> ClientError:
        return ClientError(f"The model `{model}` does not exist.", "not_found", "model")

    # --- context window ---

    def check_context(self, prompt: int, max_tokens: int | None, limit: int) -> None:
        """Raise the engine's 400 when prompt (+ requested output) cannot fit ``limit``."""
        if self.flat_errors:  # vLLM <= 0.10.0
            if max_tokens is None and prompt >= limit:
                raise ClientError(
                    f"This model's maximum context length is {limit} tokens. However, you requested "
                    f"{prompt} tokens in the messages, Please reduce the length of the messages.", "context")
            if max_tokens is not None and prompt + max_tokens > limit:
                raise ClientError(
                    f"This model's maximum context length is {limit} tokens. However, you requested "
                    f"{prompt + max_tokens} tokens ({prompt} in the messages, {max_tokens} in the "
                    f"completion). Please reduce the length of the messages or completion.", "context")
            return
        # vLLM 0.32 tokenizes one token past the window and no further; a prompt that fits
        # gets max_tokens cut to what is left (a 200), down to the "at least 1" refusal.
        if prompt > limit:
            raise ClientError(
                f"This model's maximum context length is {limit} tokens. However, your prompt "
                f"contains at least {limit + 1} input tokens, which exceeds this limit even without "
                f"any output tokens. Please reduce the length of the input prompt. "
                f"(parameter=input_tokens, value={limit + 1})", "context", "input_tokens")
        self.check_max_tokens(limit - prompt if max_tokens is None else min(max_tokens, limit - prompt))

    def check_max_tokens(self, max_tokens: int | None) -> None:
        if max_tokens is not None and max_tokens < 1:
            suffix = "" if self.flat_errors else f" (parameter=max_tokens, value={max_tokens})"
            raise ClientError(f"max_tokens must be at least 1, got {max_tokens}.{suffix}", "invalid", "max_tokens")

    def output_cap(self, prompt: int, limit: int) -> int:
        return limit - prompt

    # --- probes ---

    def health(self, healthy: bool) -> tuple[int, bytes, bytes | None]:
        return (200, b"", None) if healthy else (503, b"", None)

    def model_card(self, model: str, limit: int, created: int) -> dict[str, Any]:
        return {"id": model, "object": "model", "created": created, "owned_by": self.owned_by,
                "root": model, "parent": None, "max_model_len": limit,
                "permission": [{"id": f"modelperm-{model}", "object": "model_permission", "created": created,
                                "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                                "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                                "organization": "*", "group": None, "is_blocking": False}]}

    def not_found_route(self) -> ClientError:
        return ClientError("Not Found", "not_found", status=404)


class SGLang(Dialect):
    name = "sglang"
    owned_by = "sglang"

    def error_body(self, err: ClientError) -> tuple[int, Any]:
        status = self.status(err)
        kind = {400: "BadRequest", 404: "NotFoundError", 500: "InternalServerError",
                503: "ServiceUnavailable"}.get(status, "Error")
        return status, {"object": "error", "message": err.message, "type": kind, "param": err.param, "code": status}

    def check_context(self, prompt: int, max_tokens: int | None, limit: int) -> None:
        if prompt >= limit:
            raise ClientError(f"The input ({prompt} tokens) is longer than the model's context length "
                              f"({limit} tokens).", "context")
        if max_tokens is not None and prompt + max_tokens >= limit:
            raise ClientError(
                f"Requested token count exceeds the model's maximum context length of {limit} tokens. "
                f"You requested a total of {prompt + max_tokens} tokens: {prompt} tokens from the input "
                f"messages and {max_tokens} tokens for the completion. Please reduce the number of tokens "
                f"in the input messages or the completion to fit within the limit.", "context")

    def check_max_tokens(self, max_tokens: int | None) -> None:
        if max_tokens is not None and max_tokens < 0:
            raise ClientError(f"max_new_tokens must be at least 0, got {max_tokens}.", "invalid", "max_tokens")

    def output_cap(self, prompt: int, limit: int) -> int:
        return limit - prompt - 1

    def model_card(self, model: str, limit: int, created: int) -> dict[str, Any]:
        return {"id": model, "object": "model", "created": created, "owned_by": "sglang", "root": model,
                "max_model_len": limit}


class LlamaCpp(Dialect):
    name = "llamacpp"
    owned_by = "llamacpp"
    checks_model_name = False  # llama-server serves one model and ignores the name
    completions_default_max_tokens = None  # n_predict = -1: until EOS or the window

    _TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
              404: "not_found_error", 500: "server_error", 501: "not_supported_error", 503: "unavailable_error"}

    def error_body(self, err: ClientError) -> tuple[int, Any]:
        status = self.status(err)
        kind = "exceed_context_size_error" if err.kind == "context" else self._TYPES.get(status, "server_error")
        return status, {"error": {"code": status, "message": err.message, "type": kind, **(err.extra or {})}}

    def check_context(self, prompt: int, max_tokens: int | None, limit: int) -> None:
        if prompt >= limit:  # prompt only: max_tokens is never rejected
            raise ClientError(f"request ({prompt} tokens) exceeds the available context size ({limit} tokens), "
                              f"try increasing it", "context", extra={"n_prompt_tokens": prompt, "n_ctx": limit})

    def check_max_tokens(self, max_tokens: int | None) -> None:
        pass  # n_predict <= 0 means "no limit"

    def health(self, healthy: bool) -> tuple[int, bytes, bytes | None]:
        if healthy:
            return 200, b'{"status":"ok"}', b"application/json"
        return 503, b'{"error":{"code":503,"message":"Loading model","type":"unavailable_error"}}', b"application/json"

    def model_card(self, model: str, limit: int, created: int) -> dict[str, Any]:
        return {"id": model, "object": "model", "created": created, "owned_by": "llamacpp",
                "meta": {"vocab_type": 2, "n_vocab": 1024, "n_ctx_train": limit, "n_ctx": limit,
                         "n_embd": 4096, "n_params": 8030261248, "size": 16060522496}}

    def not_found_route(self) -> ClientError:
        return ClientError("File Not Found", "not_found", status=404)


class TGI(Dialect):
    name = "tgi"
    owned_by = "tgi"
    checks_model_name = False
    completions_default_max_tokens = None

    max_stop_sequences = 4  # TGI's defaults (/info reports them)
    max_best_of = 2

    _TYPES = {"schema": "validation", "invalid": "validation", "context": "validation",
              "overloaded": "overloaded", "injected": "generation", "not_found": "not_found"}

    def __init__(self, sse_no_space: bool = False) -> None:
        super().__init__(False)
        self.data_prefix = b"data:" if sse_no_space else b"data: "

    def status(self, err: ClientError) -> int:
        if err.status:
            return err.status
        return {"overloaded": 429, "not_found": 404}.get(err.kind, 422)

    def error_body(self, err: ClientError) -> tuple[int, Any]:
        return self.status(err), {"error": err.message, "error_type": self._TYPES.get(err.kind, "validation")}

    def stream_error_event(self, err: ClientError) -> bytes:
        return self.data_prefix + orjson.dumps(self.error_body(err)[1]) + b"\n\n"

    def chat_stream_error_event(self, err: ClientError) -> bytes:
        body = {"error": {"message": err.message, "http_status_code": self.status(err)}}
        return self.data_prefix + orjson.dumps(body) + b"\n\n"

    def check_generate(self, prompt: int, max_new_tokens: int | None, max_input: int, max_total: int) -> int:
        """TGI's validation order (router/src/validation.rs); returns the max_new_tokens to use."""
        if max_new_tokens is not None and max_new_tokens == 0:
            raise ClientError("Input validation error: `max_new_tokens` must be strictly positive")
        new = max_new_tokens if max_new_tokens is not None else max(0, max_total - prompt)
        if prompt + new > max_total:
            raise ClientError(f"Input validation error: `inputs` tokens + `max_new_tokens` must be <= "
                              f"{max_total}. Given: {prompt} `inputs` tokens and {new} `max_new_tokens`", "context")
        if prompt > max_input:
            raise ClientError(f"Input validation error: `inputs` must have less than {max_input} tokens. "
                              f"Given: {prompt}", "context")
        return new

    def health(self, healthy: bool) -> tuple[int, bytes, bytes | None]:
        if healthy:
            return 200, b"", None
        return 503, b'{"error":"unhealthy","error_type":"healthcheck"}', b"application/json"

    def model_card(self, model: str, limit: int, created: int) -> dict[str, Any]:
        return {"id": model, "object": "model", "created": 0, "owned_by": model}


class LMDeploy(Dialect):
    """LMDeploy's api_server (lmdeploy/serve/openai/api_server.py): OpenAI routes; model cards
    without a window; errors as its ``create_error_response`` writes them (message, type,
    code). Context checks are vLLM's here: LMDeploy's own wording is not reproduced."""

    name = "lmdeploy"
    owned_by = "lmdeploy"

    def error_body(self, err: ClientError) -> tuple[int, Any]:
        status = self.status(err)
        return status, {"message": err.message, "type": "invalid_request_error", "code": status}

    def model_card(self, model: str, limit: int, created: int) -> dict[str, Any]:
        return {"id": model, "object": "model", "created": created, "owned_by": "lmdeploy",
                "root": model, "parent": None, "permission": [{
                    "id": f"modelperm-{model}", "object": "model_permission", "created": created,
                    "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                    "allow_search_indices": True, "allow_view": True, "allow_fine_tuning": False,
                    "organization": "*", "group": None, "is_blocking": False}]}


def make_dialect(name: str, vllm_flat_errors: bool = False, tgi_sse_no_space: bool = False) -> Dialect:
    if name == "vllm":
        return Dialect(flat_errors=vllm_flat_errors)
    if name == "sglang":
        return SGLang()
    if name == "llamacpp":
        return LlamaCpp()
    if name == "tgi":
        return TGI(sse_no_space=tgi_sse_no_space)
    if name == "lmdeploy":
        return LMDeploy()
    raise ValueError(f"unknown dialect {name!r}")
