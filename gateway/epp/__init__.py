"""The Endpoint Picker (EPP): the gateway's admission and placement inside Envoy's data
path, over the ext_proc protocol of the Gateway API Inference Extension.

- ``wire``: the protocol's messages (read and built);
- ``exchange``: one request's conversation (admit, pick, follow the served endpoint,
  release);
- ``server``: the gRPC server (ext_proc and health);
- ``cli``: ``llm-gateway epp``.
"""
