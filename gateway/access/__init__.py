"""API keys and per-key limits: who may call, which models, how much (README "API keys and
limits"). The request path sees one object, ``AccessControl`` (control.py)."""
