"""The pass-through reader on its own: every recorded engine stream, cut at every byte, reads
back as the client must get it (what test_relay_fidelity checks through real servers for a
sample of cuts, here for all single cuts)."""

from __future__ import annotations

import pytest

from gateway.protocol.errors import Api
from gateway.protocol.translate.passthrough import EventReader
from recorded_streams import RECORDINGS

STREAMS = [r for r in RECORDINGS.values()
           if r.stream and r.path.startswith("/v1") and r.engine in ("vllm", "sglang", "llamacpp")]


@pytest.mark.parametrize("recording", STREAMS, ids=lambda r: r.name)
@pytest.mark.parametrize("wants_usage", [False, True])
def test_every_single_cut_reads_back_as_the_client_gets_it(recording, wants_usage: bool) -> None:
    data = recording.data
    expected = recording.expected(wants_usage)
    for cut in range(1, len(data)):
        reader = EventReader(Api.OPENAI, strip_usage=not wants_usage)
        first, _ = reader.feed(data[:cut])
        rest, _ = reader.feed(data[cut:])
        assert first + rest + reader.pending == expected, cut
        assert reader.finished
