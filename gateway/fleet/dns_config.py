"""The ``dns`` section of the config: how replicas given as ``{dns: NAME, port: P}`` are
resolved (``gateway/fleet/dns_discovery.py``)."""

from __future__ import annotations

import ipaddress

from pydantic import BaseModel, ConfigDict, Field, model_validator


def parse_nameserver(text: str) -> tuple[str, int]:
    """``"10.0.0.2"``, ``"127.0.0.1:5353"``, ``"::1"`` or ``"[::1]:5353"`` -> (address, port)."""
    host, port = text, 53
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = int(rest.removeprefix(":")) if rest else 53
    elif text.count(":") == 1:
        host, _, port_text = text.partition(":")
        port = int(port_text)
    ipaddress.ip_address(host)  # a name here would need a resolver to find the resolver
    if not 1 <= port <= 65535:
        raise ValueError(f"port {port} out of range")
    return host, port


class DnsConfig(BaseModel):
    """DNS discovery (replicas given as ``{dns: NAME, port: P}``)."""

    model_config = ConfigDict(extra="forbid")

    interval: float = Field(5.0, gt=0, description="seconds between resolutions: new addresses "
                            "join, vanished ones drain")
    timeout: float = Field(2.0, gt=0, description="seconds one resolution may take; a failed "
                           "one changes nothing")
    nameservers: list[str] = Field(default_factory=list, description="'ip' or 'ip:port'; empty "
                                   "= the system's (/etc/resolv.conf, with its search domains)")

    @model_validator(mode="after")
    def _nameservers(self) -> "DnsConfig":
        for server in self.nameservers:
            try:
                parse_nameserver(server)
            except ValueError:
                raise ValueError(f"nameserver {server!r} is not 'ip', 'ip:port' or "
                                 "'[ipv6]:port'") from None
        return self
