"""Precise prefix-cache routing: what each engine really holds in its KV cache, from the
events it publishes (vLLM's ``--kv-events-config``).

- ``events``: the events, whatever wire they came in on (the codec is the engine's);
- ``index``: per replica, the blocks it holds, keyed by the gateway's own hash of their
  tokens; ``PromptKeys`` cuts a prompt's token ids the same way;
- ``subscriber``: one ZMQ subscription per replica (sequence numbers, replay, restarts);
- ``feeds``: a subscription for every replica that has an events endpoint, as the fleet
  changes.
"""
