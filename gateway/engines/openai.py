"""Any OpenAI-compatible server (OpenAI's own API, or a server that copies it): embeddings and
Responses beside generation, no engine-specific fields, no load signals, and no token ids (so
no TGI streams)."""

from types import MappingProxyType

from gateway.engines.base import OPENAI_TGI_PARAMETERS, Engine


class OpenAI(Engine):
    name = "openai"
    title = "OpenAI-compatible"
    pooling_routes = frozenset({"/v1/embeddings"})
    serves_responses = True
    tgi_parameters = MappingProxyType({**OPENAI_TGI_PARAMETERS, "best_of": "n + logprobs"})


ENGINE = OpenAI()
