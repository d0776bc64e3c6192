"""The ``migration`` section of the config: whether a broken stream continues elsewhere."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class MigrationConfig(BaseModel):
    """A streamed answer whose replica dies, errs or hangs after its first token continues on
    another replica of its pool, from the tokens already sent (``gateway.migrate``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(True, description="continue broken streams on another replica")
    max_attempts: int = Field(2, ge=1, description="continuations per request (each also "
                              "spends the retry budget)")
    stall_timeout: float = Field(10.0, gt=0, description="seconds without an event on a "
                                 "stream while every other stream of its replica is silent "
                                 "too: the engine hangs")
