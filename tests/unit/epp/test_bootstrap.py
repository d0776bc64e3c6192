"""The Envoy bootstrap the picker ships (gateway/epp/bootstrap.py): deploy/envoy/envoy.yaml
is what ``llm-gateway epp --envoy-bootstrap`` writes for deploy/envoy/gateway.yaml, so a
change to one shows in the other."""

from __future__ import annotations

import pytest

from gateway.cli import main
from support import ROOT

DEPLOY = ROOT / "deploy" / "envoy"


def test_the_deployed_bootstrap_is_the_one_the_picker_writes(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["epp", "--config", str(DEPLOY / "gateway.yaml"), "--envoy-bootstrap"])
    assert done.value.code == 0
    assert capsys.readouterr().out == (DEPLOY / "envoy.yaml").read_text(), \
        "regenerate: llm-gateway epp --config deploy/envoy/gateway.yaml --envoy-bootstrap"
