"""DNS discovery: a replica entry ``{dns: NAME, port: P, engine: E}`` is one replica per
address NAME resolves to (a Kubernetes headless Service answers with every ready pod).

Every ``dns.interval`` seconds each name is resolved again. A new address joins the way an
admin-added replica does (window discovery and a health check first); a vanished one drains:
it takes no new requests, its in-flight requests finish (up to ``drain_timeout``), then it is
removed. An address that comes back while draining simply resumes. A failed resolution
(timeout, server failure) changes nothing; a name that does not exist (NXDOMAIN) or has no
address means no replicas.

Resolution uses dnspython: the system's settings (``/etc/resolv.conf``, its search domains
and ``ndots``) unless ``dns.nameservers`` names servers (``ip`` or ``ip:port``).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import dns.asyncresolver
import dns.exception
import dns.nameserver
import dns.resolver

from gateway.config import Settings
from gateway.fleet.dns_config import DnsConfig, parse_nameserver
from gateway.fleet.role import Role
from gateway.fleet.replica import Replica

log = logging.getLogger("gateway.dns")


@dataclass(frozen=True, slots=True)
class DnsTarget:
    """One ``dns:`` replica entry of the config."""

    model: str
    pool: str
    name: str  # the DNS name
    port: int
    engine: str
    max_model_len: int | None = None
    prefix: str | None = None  # the entry's `name`: replicas are then called PREFIX-ADDRESS
    role: Role = Role.BOTH

    def replica_name(self, address: str) -> str:
        return f"{self.prefix}-{address}" if self.prefix else f"{_host(address)}:{self.port}"

    def url(self, address: str) -> str:
        return f"http://{_host(address)}:{self.port}"


def _host(address: str) -> str:
    return f"[{address}]" if ipaddress.ip_address(address).version == 6 else address


def targets(settings: Settings) -> list[DnsTarget]:
    return [DnsTarget(model.name, pool.name, entry.dns, entry.port, entry.engine,
                      entry.max_model_len, entry.name, entry.role)
            for model in settings.models for pool in model.pools or []
            for entry in pool.replicas if entry.dns is not None]


class Resolver(Protocol):
    async def resolve(self, name: str) -> frozenset[str] | None:
        """The name's addresses now; None when there was no usable answer (keep the old)."""


class DnsResolver:
    """dnspython's asyncio resolver: IPv4 addresses, else IPv6 ones (a dual-stack pod is one
    replica, not two)."""

    def __init__(self, config: DnsConfig) -> None:
        if config.nameservers:
            self._resolver = dns.asyncresolver.Resolver(configure=False)
            self._resolver.nameservers = [dns.nameserver.Do53Nameserver(*parse_nameserver(s))
                                          for s in config.nameservers]
        else:
            self._resolver = dns.asyncresolver.Resolver()  # /etc/resolv.conf
        self._resolver.lifetime = config.timeout

    async def resolve(self, name: str) -> frozenset[str] | None:
        for rdtype in ("A", "AAAA"):
            try:
                answer = await self._resolver.resolve(name, rdtype, search=True)
            except dns.resolver.NXDOMAIN:
                return frozenset()
            except dns.resolver.NoAnswer:
                continue
            except dns.exception.DNSException as exc:
                log.warning("resolving %s failed (%s): replicas unchanged", name, exc)
                return None
            return frozenset(record.address for record in answer)
        return frozenset()


class Fleet(Protocol):
    """What discovery changes: ``gateway.app.Gateway``."""

    async def add_replica(self, model: str, pool: str, url: str, engine: str,
                          name: str | None = None,
                          max_model_len: int | None = None) -> Replica: ...

    def remove_replica(self, name: str) -> Replica: ...


class DnsDiscovery:
    """Keeps each ``dns:`` entry's replicas equal to what its name resolves to."""

    def __init__(self, targets: Sequence[DnsTarget], resolver: Resolver, fleet: Fleet,
                 in_flight: Callable[[str], int], interval: float, drain_timeout: float) -> None:
        self.targets = list(targets)
        self.resolver = resolver
        self.fleet = fleet
        self.in_flight = in_flight  # replica name -> this gateway's requests in flight there
        self.interval = interval
        self.drain_timeout = drain_timeout
        self._members: dict[DnsTarget, dict[str, Replica]] = {t: {} for t in self.targets}
        self._draining: dict[str, tuple[Replica, float]] = {}  # name -> (replica, deadline)

    @classmethod
    def from_settings(cls, settings: Settings, fleet: Fleet,
                      in_flight: Callable[[str], int]) -> "DnsDiscovery | None":
        found = targets(settings)
        if not found:
            return None
        return cls(found, DnsResolver(settings.dns), fleet, in_flight, settings.dns.interval,
                   settings.drain_timeout)

    async def refresh(self) -> None:
        """One round: resolve every name, add and drain replicas, remove drained ones."""
        answers = await asyncio.gather(*(self.resolver.resolve(t.name) for t in self.targets))
        for target, addresses in zip(self.targets, answers):
            if addresses is not None:
                await self._update(target, addresses)
        self._remove_drained()

    async def _update(self, target: DnsTarget, addresses: frozenset[str]) -> None:
        members = self._members[target]
        for address in sorted(addresses - members.keys()):
            name = target.replica_name(address)
            if name in self._draining:  # came back before it was gone: take traffic again
                replica, _ = self._draining.pop(name)
                replica.draining = False
                log.info("%s: %s is back", target.name, name)
            else:
                try:
                    replica = await self.fleet.add_replica(
                        target.model, target.pool, target.url(address), target.engine, name,
                        target.max_model_len, target.role)
                except ValueError as exc:  # e.g. the same replica is also listed by url
                    log.warning("%s: %s not added: %s", target.name, name, exc)
                    continue
                log.info("%s: %s joined (%s)", target.name, name,
                         "healthy" if replica.healthy else "not healthy yet")
            members[address] = replica
        for address in sorted(members.keys() - addresses):
            replica = members.pop(address)
            replica.draining = True
            self._draining[replica.name] = (replica, time.monotonic() + self.drain_timeout)
            log.info("%s: %s vanished: draining", target.name, replica.name)

    def _remove_drained(self) -> None:
        now = time.monotonic()
        for name, (replica, deadline) in list(self._draining.items()):
            busy = self.in_flight(name)
            if busy and now < deadline:
                continue
            del self._draining[name]
            try:
                self.fleet.remove_replica(name)
            except KeyError:  # an admin removed it already
                continue
            if busy:
                log.warning("%s: drain timeout, removed with %d requests in flight", name, busy)
            else:
                log.info("%s: drained, removed", name)

    async def run(self) -> None:
        """Refresh every ``interval`` seconds, forever (cancel to stop)."""
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.refresh()
            except Exception:  # never let one bad round end discovery
                log.exception("DNS discovery round failed")
