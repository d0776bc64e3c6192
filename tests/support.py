"""Real servers on loopback for integration tests: start, wait until ready, stop."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Iterator, TypeVar

import httpx

from benchmarks.harness import free_port  # one for the tests and the benchmarks

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ROOT / ".tools" / "bin"  # linters and validators that scripts/setup.sh installs


def tool(name: str) -> str:
    """Path of a command-line tool the set-up installed (no skip when missing: a defect)."""
    path = TOOLS / name
    assert path.exists(), f"{path} missing: run `make test` (scripts/setup.sh test installs it)"
    return str(path)


# checkov, offline: no guideline download, no update check (tests talk to loopback only).
CHECKOV_ENV = {"BC_SKIP_MAPPING": "TRUE", "CKV_SKIP_PACKAGE_UPDATE_CHECK": "TRUE"}


def checkov(*args: str) -> list[dict]:
    """checkov's JSON report(s) for ``args`` (one per framework), offline."""
    import json

    result = subprocess.run([tool("checkov"), "--skip-download", "-o", "json", *args],
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, **CHECKOV_ENV})
    assert result.stdout.strip(), result.stderr[-3000:]
    reports = json.loads(result.stdout)
    return reports if isinstance(reports, list) else [reports]


def wait_ready(url: str, timeout: float = 60.0, proc: subprocess.Popen | None = None) -> None:
    """Poll ``url`` until it answers (any status below 500), bounded by ``timeout``."""
    last: list[Exception] = []

    def answers() -> bool:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before {url} was ready")
        try:
            return httpx.get(url, timeout=1.0).status_code < 500
        except httpx.HTTPError as exc:
            last[:] = [exc]
            return False

    try:
        wait_until(answers, timeout, f"{url} ready")
    except AssertionError:
        raise TimeoutError(f"{url} not ready after {timeout}s: {last[0] if last else None}") \
            from None


T = TypeVar("T")


async def _answer(value: object) -> object:
    return await value if inspect.isawaitable(value) else value


def _describe(what: str | Callable[[], object]) -> object:
    return what() if callable(what) else what


def wait_until(predicate: Callable[[], object], timeout: float = 10.0,
               what: str | Callable[[], object] = "the condition", every: float = 0.05) -> float:
    """Poll ``predicate`` until it holds (bounded by ``timeout``); the seconds it took.

    ``what`` names the condition in the failure; a callable is asked at the timeout, so the
    failure can show the state then. The predicate may raise to stop early (a server that
    exited will never become ready)."""
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout:
            raise AssertionError(f"not within {timeout} s: {_describe(what)}")
        time.sleep(every)
    return time.monotonic() - started


def wait_for_value(get: Callable[[], T], done: Callable[[T], object], timeout: float = 10.0,
                   what: str = "the value", every: float = 0.05) -> T:
    """Poll ``get()`` until ``done(value)`` holds; that value. A timeout fails with ``what``
    and the last value seen."""
    started = time.monotonic()
    while not done(value := get()):
        if time.monotonic() - started > timeout:
            raise AssertionError(f"not within {timeout} s: {what}; last: {repr(value)[:3000]}")
        time.sleep(every)
    return value


def settle(get: Callable[[], T], done: Callable[[T], object], timeout: float = 10.0,
           every: float = 0.05) -> T:
    """Poll ``get()`` until ``done(value)`` holds, bounded; the value then, or the last one
    at the timeout without an error: for callers whose own assertions on the value say
    better what is wrong (or that assert it did not settle)."""
    started = time.monotonic()
    while not done(value := get()) and time.monotonic() - started <= timeout:
        time.sleep(every)
    return value


async def wait_until_async(predicate: Callable[[], object], timeout: float = 10.0,
                           what: str | Callable[[], object] = "the condition",
                           every: float = 0.05) -> float:
    """``wait_until`` inside an event loop: sleeps without blocking it; ``predicate`` may be
    a coroutine function (its answer is awaited)."""
    started = time.monotonic()
    while not await _answer(predicate()):
        if time.monotonic() - started > timeout:
            raise AssertionError(f"not within {timeout} s: {_describe(what)}")
        await asyncio.sleep(every)
    return time.monotonic() - started


@contextlib.contextmanager
def running(args: list[str], ready_url: str, env: dict[str, str] | None = None,
            timeout: float = 60.0) -> Iterator[subprocess.Popen]:
    """Run ``python -m gateway ARGS`` until the block ends; yield the process.

    Its stderr goes to a file, not a pipe: a server that logs more than a pipe holds while
    nobody reads would block on its next log line.
    """
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", *args], cwd=ROOT,
            env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL, stderr=log)
        try:
            try:
                wait_ready(ready_url, timeout, proc)
            except Exception:
                proc.kill()
                proc.wait(timeout=5)
                log.seek(0)
                err = log.read()[-3000:].decode(errors="replace")
                raise RuntimeError(f"{args} failed to start:\n{err}")
            yield proc
        finally:
            stop(proc)


def stop(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """SIGTERM (a gateway drains first), then SIGKILL after ``timeout``; close its pipes."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if proc.stderr:
        proc.stderr.close()


KV_EVENTS_PORT_OFFSET = 1000  # the gateway's kv_events.port_offset default
KV_REPLAY_PORT_OFFSET = 2000  # and its replay_port_offset


@contextlib.contextmanager
def sim(dialect: str = "vllm", model: str = "sim-model", max_model_len: int = 4096,
        *extra: str, port: int | None = None, host: str = "127.0.0.1",
        kv_events: bool = False) -> Iterator[str]:
    """A simulated replica (``llm-gateway sim``) on loopback (any 127.x.y.z ``host``); yields
    its base URL.

    ``kv_events``: it publishes KV cache events on its HTTP port + 1000 and answers replays
    on + 2000, the gateway's default ``kv_events`` offsets (``extra`` must then name a
    vllm-v1 profile and ``--prefix-cache``).

    A free port can be taken by someone else between our probe and the server's bind, so a
    replica that fails to start is tried once more on another port.
    """
    for attempt in (1, 2):
        chosen = port or free_port()
        args = ["sim", "--dialect", dialect, "--host", host, "--port", str(chosen),
                "--model", model, "--max-model-len", str(max_model_len), *extra]
        if kv_events:
            args += ["--kv-events-port", str(chosen + KV_EVENTS_PORT_OFFSET),
                     "--kv-replay-port", str(chosen + KV_REPLAY_PORT_OFFSET)]
        try:
            server = running(args, f"http://{host}:{chosen}/health")
            server.__enter__()
        except RuntimeError:
            if attempt == 2 or port is not None:
                raise
            continue
        try:
            yield f"http://{host}:{chosen}"
        finally:
            server.__exit__(None, None, None)
        return


@contextlib.contextmanager
def sim_process(*extra: str) -> Iterator[tuple[str, subprocess.Popen]]:
    """A simulated vLLM replica of ``sim-model`` (window 4096) on a free loopback port, with
    ``extra`` flags; yields its base URL and its process (to kill or stop it)."""
    port = free_port()
    with running(["sim", "--dialect", "vllm", "--port", str(port), "--model", "sim-model",
                  "--max-model-len", "4096", *extra],
                 f"http://127.0.0.1:{port}/health") as proc:
        yield f"http://127.0.0.1:{port}", proc


@contextlib.contextmanager
def gateway_server(config_dir: Path, config: dict, ready_path: str = "/ready",
                   *extra_args: str) -> Iterator[tuple[str, subprocess.Popen]]:
    """``llm-gateway serve`` with ``config`` (a settings dict); yields (base URL, process)."""
    import yaml

    port = free_port()
    path = config_dir / f"gateway-{port}.yaml"
    path.write_text(yaml.safe_dump(config))
    with running(["serve", "--config", str(path), "--port", str(port), "--log-level", "warning",
                  *extra_args], f"http://127.0.0.1:{port}{ready_path}") as proc:
        yield f"http://127.0.0.1:{port}", proc


def server_started(server, thread: threading.Thread, name: str) -> bool:  # noqa: ANN001
    """A uvicorn server in ``thread`` has started; an error once the thread ended without."""
    if server.started:
        return True
    assert thread.is_alive(), f"{name} exited at startup"
    return False


@contextlib.contextmanager
def uvicorn_in_thread(app, **config) -> Iterator[int]:  # noqa: ANN001 - any ASGI app
    """``app`` served by uvicorn on a free loopback port in a thread of this process (so a
    test can look inside it); yields the port. ``config``: uvicorn.Config options."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning", **config))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server_started(server, thread, "uvicorn"), 20, "uvicorn to start", 0.02)
        yield port
    finally:
        server.should_exit = True
        thread.join(30)


class StreamInThread:
    """One streamed request read on a thread: its status, replica and SSE events as the
    client saw them. ``started`` is set once the answer's head arrived (or the request
    failed)."""

    def __init__(self, url: str, body: dict, timeout: float = 30.0,
                 headers: dict[str, str] | None = None) -> None:
        self.url, self.body, self.timeout, self.headers = url, body, timeout, headers or {}
        self.status: int | None = None
        self.started_at: float | None = None  # time.monotonic() of the answer's head
        self.replica: str | None = None
        self.events: list[bytes] = []
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            with httpx.stream("POST", self.url, json=self.body, timeout=self.timeout,
                              headers=self.headers) as response:
                self.status = response.status_code
                self.replica = response.headers.get("x-gateway-replica")
                self.started_at = time.monotonic()
                self.started.set()
                self.events = [e for e in response.read().split(b"\n\n") if e]
        finally:
            self.started.set()

    def join(self) -> "StreamInThread":
        self.thread.join(self.timeout * 1.5)
        assert not self.thread.is_alive()
        return self

    @property
    def ended_with_error_event(self) -> bool:
        """A 200 stream cut by the gateway's error event, then [DONE]."""
        return (self.status == 200 and self.events[-1] == b"data: [DONE]"
                and self.events[-2].startswith(b'data: {"error":'))
