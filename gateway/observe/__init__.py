"""Per-request observability, built from the data path's outcome records
(``gateway.dataplane.outcome``): listeners registered at wiring, nothing in the request path.

- ``access_log``: one JSON line per client request when it ends.
- ``tracing``: an OpenTelemetry trace per request (request, admission, queue wait, each
  attempt) exported over OTLP/HTTP, its context passed to the engine as ``traceparent``.

Neither ever records a prompt, an output text or an API key's secret (a key's name only).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gateway.config import Settings
    from gateway.dataplane.outcome import Listener


def listeners(settings: "Settings") -> list["Listener"]:
    """The observers ``settings`` turn on, to register with the outcomes (none by default;
    OpenTelemetry is imported only when tracing is on)."""
    found: list[Listener] = []
    if settings.tracing.enabled:  # first: the access log reads the trace id it sets
        from gateway.observe.tracing import from_config

        found.append(from_config(settings.tracing))
    if settings.access_log.enabled:
        from gateway.observe.access_log import AccessLog

        found.append(AccessLog(settings.access_log))
    return found


def check(settings: "Settings") -> None:
    """Raise ConfigError for what the settings alone cannot tell: an access log file that
    cannot be opened, an OTEL_TRACES_SAMPLER_ARG that is no ratio (at start, before any
    worker process, rather than as each worker's traceback)."""
    from gateway.config import ConfigError

    if settings.tracing.enabled and settings.tracing.sampling is None:
        from gateway.observe.tracing import env_ratio

        env_ratio()
    if settings.access_log.enabled and settings.access_log.path != "-":
        from gateway.observe.access_log import open_log

        try:
            os.close(open_log(settings.access_log.path))
        except OSError as exc:
            raise ConfigError(f"access_log.path: cannot append to "
                              f"{settings.access_log.path}: {exc.strerror}") from None


async def close(observers: list["Listener"]) -> None:
    """Write out what they hold (at shutdown)."""
    for observer in observers:
        closing = getattr(observer, "aclose", None)
        if closing is not None:
            await closing()
