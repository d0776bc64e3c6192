"""Redis for tests: the machine's shared server with a private key prefix, or a private
``redis-server`` on a free port that a test may kill and restart."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import uuid
from pathlib import Path
from typing import Iterator

import redis

from support import free_port, wait_until

SHARED_URL = "redis://127.0.0.1:6379/0"


def unique_prefix() -> str:
    return f"llm-gateway-test:{uuid.uuid4().hex[:10]}:"


def delete_prefix(url: str, prefix: str) -> None:
    client = redis.Redis.from_url(url)
    try:
        keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


@contextlib.contextmanager
def shared_prefix() -> Iterator[str]:
    """A key prefix of its own on the shared Redis, deleted afterwards."""
    prefix = unique_prefix()
    try:
        yield prefix
    finally:
        delete_prefix(SHARED_URL, prefix)


class PrivateRedis:
    """A redis-server of this test's own, on a fixed free port, that can be stopped and
    started again (the machine's shared Redis must never be)."""

    def __init__(self, directory: Path) -> None:
        if shutil.which("redis-server") is None:
            raise RuntimeError("redis-server is not installed")
        self.directory = directory
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.directory)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=1)
        def answers() -> bool:
            try:
                return bool(client.ping())
            except redis.ConnectionError:
                assert self.proc.poll() is None, f"redis-server on port {self.port} exited"
                return False

        try:
            wait_until(answers, 10, f"redis-server on port {self.port} to start")
        except AssertionError:
            self.kill()  # never leave a server behind that the test cannot reach
            raise
        finally:
            client.close()

    def kill(self) -> None:
        """SIGKILL: Redis gone at once, all its data with it (no persistence)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=2, decode_responses=True)


@contextlib.contextmanager
def private_redis(directory: Path) -> Iterator[PrivateRedis]:
    server = PrivateRedis(directory)
    server.start()
    try:
        yield server
    finally:
        server.kill()
