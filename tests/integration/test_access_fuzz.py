"""Hostile Authorization headers and admin bodies: always a clear 4xx (or a success for a
valid key), never a 500, and no secret echoed back."""

from __future__ import annotations

import json
from typing import Iterator
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from access_support import MODEL, key, serving
from support import sim

SECRET = "sk-gw-fuzz-0123456789"
ADMIN = "fuzz-admin"


@pytest.fixture(scope="module")
def gateway() -> Iterator[str]:
    with sim("vllm", MODEL, 4096, "--profile", "instant") as replica:
        with serving({"models": [{"name": MODEL, "replicas": [{"url": replica}]}],
                      "admin_token": ADMIN,
                      "auth": {"keys": [key("fuzz", SECRET, limits={
                          "requests_per_minute": 100000})]}}) as url:
            yield url


# What HTTP allows in a field value (visible ASCII, obs-text, inner spaces and tabs); other
# bytes never reach the gateway (the client or the HTTP parser refuses them first).
_FIELD = [*range(0x21, 0x7F), *range(0x80, 0x100)]
header_bytes = st.lists(st.sampled_from(_FIELD) | st.sampled_from([0x20, 0x09]), min_size=1,
                        max_size=300).map(bytes).map(lambda b: b.strip(b" \t")).filter(bool)
authorizations = st.one_of(
    header_bytes, header_bytes.map(lambda b: b"Bearer " + b),
    st.sampled_from([b"Bearer", b"bearer " + SECRET.encode(),
                     b"Bearer  " + SECRET.encode(), b"Basic " + SECRET.encode(),
                     b"Bearer " + SECRET.encode() * 40, SECRET.encode()]))


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(authorization=authorizations, path=st.sampled_from(["/v1/completions", "/generate"]))
def test_any_authorization_header_is_a_clear_answer(gateway: str, authorization: bytes,
                                                    path: str) -> None:
    body = ({"model": MODEL, "prompt": "hi", "max_tokens": 2} if path.startswith("/v1")
            else {"inputs": "hi", "parameters": {"max_new_tokens": 2}})
    answer = httpx.post(gateway + path, json=body, headers={"authorization": authorization})
    assert answer.status_code in (200, 401), answer.text
    if answer.status_code == 401:
        error = answer.json()
        if path.startswith("/v1"):
            assert error["error"]["code"] == "invalid_api_key"
        else:
            assert set(error) == {"error", "error_type"}
        assert SECRET not in answer.text


names = st.text(max_size=80) | st.sampled_from(["ok-name", "fuzz", "a" * 64, "a" * 65, ""])
limit_values = st.none() | st.integers(-5, 10**20) | st.floats(allow_nan=True) | st.text(max_size=5)
admin_bodies = st.one_of(
    st.fixed_dictionaries({"name": names}, optional={
        "models": st.none() | st.lists(st.text(max_size=10) | st.just(MODEL), max_size=3)
        | st.text(max_size=5),
        "weight": limit_values,
        "limits": st.dictionaries(st.sampled_from(["requests_per_minute", "tokens_per_minute",
                                                    "concurrent_requests", "bogus"]),
                                  limit_values, max_size=4) | limit_values,
        "sha256": st.text(max_size=10)}),
    st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=10),
                 lambda inner: st.lists(inner, max_size=3)
                 | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=8))


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=admin_bodies)
def test_any_admin_body_is_a_clear_answer(gateway: str, body: object) -> None:
    admin = {"Authorization": f"Bearer {ADMIN}"}
    raw = json.dumps(body, allow_nan=True).encode()
    answer = httpx.post(gateway + "/admin/keys", content=raw, headers={
        **admin, "content-type": "application/json"})
    assert answer.status_code in (201, 409, 422), answer.text
    if answer.status_code == 201:
        created = answer.json()
        assert "sha256" not in created
        gone = httpx.delete(gateway + f"/admin/keys/{created['name']}", headers=admin)
        assert gone.status_code == 200
    listing = httpx.get(gateway + "/admin/keys", headers=admin)
    assert listing.status_code == 200 and "sha256" not in listing.text


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(name=st.text(min_size=1, max_size=100).filter(lambda n: "/" not in n and n not in ".."))
def test_any_revoked_name_is_a_clear_answer(gateway: str, name: str) -> None:
    answer = httpx.delete(gateway + "/admin/keys/" + quote(name, safe=""),
                          headers={"Authorization": f"Bearer {ADMIN}"})
    assert answer.status_code in (404, 409), answer.text
