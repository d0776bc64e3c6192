"""API keys and per-key limits: who may call, which models, how much (docs/keys-and-limits.md "API keys and
limits"). The request path sees one object, ``AccessControl`` (control.py)."""
