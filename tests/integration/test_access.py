"""API keys with the real clients: 401, 403 and 429 as the clients' own exception types,
the x-ratelimit-* headers, the admin API (create / list / revoke), probes without a key,
and no secret in logs, /metrics or listings."""

from __future__ import annotations

import logging
from typing import Iterator

import httpx
import openai
import pytest
from text_generation import Client as TGIClient
from text_generation.errors import OverloadedError, ShardNotReadyError, UnknownError

from access_support import MODEL, key, serving
from support import sim

OTHER = "other-model"
ADMIN = "admin-secret-token"
SECRETS = {"open": "sk-gw-open-0123456789", "narrow": "sk-gw-narrow-0123456789",
           "elsewhere": "sk-gw-elsewhere-0123456789",
           "tight": "sk-gw-tight-0123456789", "tgi": "sk-gw-tgi-0123456789"}


@pytest.fixture(scope="module")
def gateway() -> Iterator[str]:
    with sim("vllm", MODEL, 4096, "--profile", "instant") as replica:
        replicas = [{"url": replica, "engine": "vllm"}]
        settings = {
            "models": [{"name": MODEL, "replicas": replicas},
                       {"name": OTHER, "replicas": [{"url": replica, "engine": "vllm",
                                                     "name": "other"}]}],
            "default_model": MODEL, "health": {"interval": 0.5}, "admin_token": ADMIN,
            "auth": {"keys": [
                key("open", SECRETS["open"]),
                key("narrow", SECRETS["narrow"], models=[MODEL], weight=2),
                key("elsewhere", SECRETS["elsewhere"], models=[OTHER]),
                key("tight", SECRETS["tight"], limits={"requests_per_minute": 2,
                                                       "tokens_per_minute": 100000}),
                key("tgi", SECRETS["tgi"], limits={"requests_per_minute": 1}),
            ]},
        }
        with serving(settings) as url:
            yield url


def client(url: str, secret: str | None) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=secret or "", max_retries=0)


def complete(api: openai.OpenAI, model: str = MODEL):
    return api.completions.with_raw_response.create(model=model, prompt="hello", max_tokens=5)


def test_missing_or_unknown_key_is_401_invalid_api_key(gateway: str) -> None:
    for secret in ("sk-gw-wrong", SECRETS["open"] + "x", "Bearer"):
        with pytest.raises(openai.AuthenticationError) as caught:
            complete(client(gateway, secret))
        assert caught.value.status_code == 401
        assert caught.value.code == "invalid_api_key"
        assert caught.value.response.headers["www-authenticate"] == "Bearer"
    # No Authorization header at all (the openai client always sends one).
    answer = httpx.post(gateway + "/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert answer.status_code == 401
    assert answer.json()["error"]["code"] == "invalid_api_key"


def test_valid_key_is_served_without_limit_headers(gateway: str) -> None:
    raw = complete(client(gateway, SECRETS["open"]))
    assert raw.http_response.status_code == 200
    assert raw.parse().choices[0].text
    assert not any(h.startswith("x-ratelimit") for h in raw.headers)
    chat = client(gateway, SECRETS["open"]).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chat if c.choices)


def test_model_outside_the_allowlist_is_403(gateway: str) -> None:
    narrow = client(gateway, SECRETS["narrow"])
    with pytest.raises(openai.PermissionDeniedError) as caught:
        complete(narrow, OTHER)
    assert caught.value.status_code == 403
    assert caught.value.code == "model_not_allowed"
    assert complete(narrow, MODEL).http_response.status_code == 200


def test_over_the_request_limit_is_429_with_openai_headers(gateway: str) -> None:
    tight = client(gateway, SECRETS["tight"])
    first = complete(tight)
    assert first.headers["x-ratelimit-limit-requests"] == "2"
    assert first.headers["x-ratelimit-remaining-requests"] == "1"
    assert first.headers["x-ratelimit-limit-tokens"] == "100000"
    assert int(first.headers["x-ratelimit-remaining-tokens"]) < 100000
    assert first.headers["x-ratelimit-reset-requests"].endswith("s")
    second = complete(tight)
    assert second.headers["x-ratelimit-remaining-requests"] == "0"
    with pytest.raises(openai.RateLimitError) as caught:
        complete(tight)
    headers = caught.value.response.headers
    assert caught.value.status_code == 429
    assert caught.value.code == "rate_limit_exceeded"
    assert 1 <= int(headers["retry-after"]) <= 60
    assert headers["x-ratelimit-limit-requests"] == "2"
    assert headers["x-ratelimit-remaining-requests"] == "0"
    for name in ("reset-requests", "limit-tokens", "remaining-tokens", "reset-tokens"):
        assert f"x-ratelimit-{name}" in headers


def test_tgi_client_gets_its_own_exceptions(gateway: str) -> None:
    with pytest.raises(UnknownError):  # the TGI client's type for a 401
        TGIClient(gateway, headers={"Authorization": "Bearer nope"}).generate("hi")
    with pytest.raises(ShardNotReadyError):  # ... and for a 403
        TGIClient(gateway, headers={"Authorization": f"Bearer {SECRETS['elsewhere']}"},
                  ).generate("hi", max_new_tokens=3)
    allowed = TGIClient(gateway, headers={"Authorization": f"Bearer {SECRETS['tgi']}"})
    assert allowed.generate("hi", max_new_tokens=3).generated_text
    with pytest.raises(OverloadedError):  # 429, TGI's `overloaded`
        allowed.generate("hi", max_new_tokens=3)
    answer = httpx.post(gateway + "/generate", json={"inputs": "x"},
                        headers={"Authorization": f"Bearer {SECRETS['tgi']}"})
    assert answer.status_code == 429
    assert answer.json()["error_type"] == "overloaded"
    assert answer.headers["x-ratelimit-limit-requests"] == "1"
    assert "retry-after" in answer.headers


def test_probes_and_metrics_need_no_key(gateway: str) -> None:
    for path in ("/health", "/ready", "/metrics"):
        assert httpx.get(gateway + path).status_code == 200
    metrics = httpx.get(gateway + "/metrics").text
    for reason in ("unauthorized", "forbidden", "rate_limited"):
        assert f'reason="{reason}"' in metrics


def test_rejections_are_counted_by_reason(gateway: str) -> None:
    def count(reason: str) -> float:
        text = httpx.get(gateway + "/metrics").text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("llm_gateway_rejections_total")
                   and f'reason="{reason}"' in line and f'model="{MODEL}"' in line)
    before = count("unauthorized"), count("forbidden")
    with pytest.raises(openai.AuthenticationError):
        complete(client(gateway, "wrong"))
    with pytest.raises(openai.PermissionDeniedError):
        complete(client(gateway, SECRETS["elsewhere"]))
    assert (count("unauthorized"), count("forbidden")) == (before[0] + 1, before[1] + 1)


def key_series(gateway: str, name: str, **labels: str) -> float:
    """The sum of a per-key series' samples whose labels include ``labels``."""
    text = httpx.get(gateway + "/metrics").text
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and all(w in line for w in want))


def test_per_key_requests_tokens_and_rejections(gateway: str) -> None:
    """Each key's own figures, labelled by its name (never its secret)."""
    def figures(key: str) -> tuple[float, ...]:
        return (key_series(gateway, "llm_gateway_key_requests_total", key=key),
                key_series(gateway, "llm_gateway_key_prompt_tokens_total", key=key),
                key_series(gateway, "llm_gateway_key_generation_tokens_total", key=key),
                key_series(gateway, "llm_gateway_key_rejections_total", key=key,
                           reason="forbidden"))
    before = {k: figures(k) for k in ("open", "narrow", "elsewhere")}
    usage = [complete(client(gateway, SECRETS["open"])).parse().usage for _ in range(3)]
    narrow = complete(client(gateway, SECRETS["narrow"])).parse().usage
    with pytest.raises(openai.PermissionDeniedError):
        complete(client(gateway, SECRETS["elsewhere"]))
    after = {k: figures(k) for k in before}
    assert [a - b for a, b in zip(after["open"], before["open"])] == [
        3, sum(u.prompt_tokens for u in usage), sum(u.completion_tokens for u in usage), 0]
    assert [a - b for a, b in zip(after["narrow"], before["narrow"])] == [
        1, narrow.prompt_tokens, narrow.completion_tokens, 0]
    assert [a - b for a, b in zip(after["elsewhere"], before["elsewhere"])] == [0, 0, 0, 1]
    text = httpx.get(gateway + "/metrics").text
    assert not any(secret in text for secret in SECRETS.values())
    # Every configured key's series exist from the start (a dashboard shows 0, not no data).
    assert key_series(gateway, "llm_gateway_key_queue_time_seconds_count", key="tight") == 0
    assert 'llm_gateway_key_rejections_total{key="tgi",model="' in text


def test_admin_create_list_revoke(gateway: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    admin = {"Authorization": f"Bearer {ADMIN}"}
    assert httpx.post(gateway + "/admin/keys", json={"name": "x"}).status_code == 401
    created = httpx.post(gateway + "/admin/keys", headers=admin,
                         json={"name": "runtime", "models": [MODEL],
                               "limits": {"requests_per_minute": 100}})
    assert created.status_code == 201, created.text
    secret = created.json()["secret"]
    assert secret.startswith("sk-gw-") and len(secret) > 40
    assert httpx.post(gateway + "/admin/keys", headers=admin,
                      json={"name": "runtime"}).status_code == 409
    listing = httpx.get(gateway + "/admin/keys", headers=admin)
    names = {k["name"]: k for k in listing.json()["keys"]}
    assert set(names) >= {"open", "narrow", "elsewhere", "tight", "tgi", "runtime"}
    assert names["runtime"]["source"] == "admin" and names["open"]["source"] == "config"
    assert "sha256" not in listing.text and secret not in listing.text
    raw = complete(client(gateway, secret))
    assert raw.headers["x-ratelimit-limit-requests"] == "100"
    assert httpx.delete(gateway + "/admin/keys/open", headers=admin).status_code == 409
    assert httpx.delete(gateway + "/admin/keys/runtime", headers=admin).status_code == 200
    assert httpx.delete(gateway + "/admin/keys/runtime", headers=admin).status_code == 404
    with pytest.raises(openai.AuthenticationError):
        complete(client(gateway, secret))
    assert secret not in httpx.get(gateway + "/metrics").text
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "runtime" in logged  # the create and revoke were logged...
    for value in (secret, *SECRETS.values()):
        assert value not in logged  # ...without any secret


def test_ops_token_guards_probes_when_set() -> None:
    with sim("vllm", MODEL, 4096, "--profile", "instant") as replica:
        settings = {"models": [{"name": MODEL, "replicas": [{"url": replica}]}],
                    "auth": {"keys": [], "ops_token": "probe-token"}}
        with serving(settings) as url:
            for path in ("/health", "/ready", "/metrics"):
                assert httpx.get(url + path).status_code == 401
                assert httpx.get(url + path, headers={
                    "Authorization": "Bearer probe-token"}).status_code == 200


def test_huggingface_hub_client_sends_its_token(gateway: str) -> None:
    from huggingface_hub import InferenceClient
    from huggingface_hub.inference._common import OverloadedError as HubOverloaded
    from huggingface_hub.inference._common import UnknownError as HubUnknown

    allowed = InferenceClient(base_url=gateway, token=SECRETS["open"])
    assert allowed.text_generation("hi", max_new_tokens=3)
    with pytest.raises(HubUnknown) as caught:  # TGI's shape, parsed by the hub client
        InferenceClient(base_url=gateway, token="hf_wrong").text_generation("hi",
                                                                           max_new_tokens=3)
    assert caught.value.__cause__.response.status_code == 401
    tight = InferenceClient(base_url=gateway, token=SECRETS["tgi"])
    with pytest.raises(HubOverloaded):  # the "tgi" key's one request a minute is spent
        for _ in range(2):
            tight.text_generation("hi", max_new_tokens=3)
