"""An answer that survives the engine under it: a stream that breaks after its first token
(the engine died, hung, or sent an error event) goes on on another replica of its pool, from
the token ids already generated, and the client sees one unbroken stream.

- ``exactness``: which requests can be continued exactly, and why the others cannot;
- ``token_log``: the prompt's and the generated tokens' ids, read off the stream as it passes;
- ``continuation``: what the next replica is sent, and how its events join the stream;
- ``migrator``: placing and sending the continuation, within the retry budget and
  ``migration.max_attempts`` (the relay, ``gateway.dataplane.relay``, detects the break);
- ``metrics``: what was continued, why, and what it cost.
"""
