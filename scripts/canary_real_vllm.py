"""Output agreement and the verdict on real engines (docs/canary.md "Canary", measured on vLLM).

Two vLLM engines with the same weights, one fp32 and one bf16, already running (vLLM's
OpenAI server, served model name `tiny`); this starts two gateways sharing the local Redis
(a key prefix of their own), a real `prometheus` scraping both, and sends N greedy requests
(half streamed, half whole; completions and chat) alternating between the gateways. The
baseline pool `stable` is the fp32 engine; `bf16` shadows it, and so does `self`: the fp32
engine again under another replica name (its own greedy noise). Prints how every pair ended
(compared or dropped, per shadow pool, both instances), the sample-based reports from either
instance, and the Prometheus-only reports on the same traffic.

  python scripts/canary_real_vllm.py FP32_URL BF16_URL [N]
"""
import concurrent.futures, json, subprocess, sys, tempfile, time, uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import httpx, yaml  # noqa: E402
from support import gateway_server, free_port, stop, wait_ready, ROOT  # noqa: E402
from redis_support import SHARED_URL, delete_prefix  # noqa: E402

FP32, BF16 = sys.argv[1], sys.argv[2]
TOKEN = "real-canary-admin-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
N = int(sys.argv[3]) if len(sys.argv) > 3 else 200
prefix = f"canary-real:{uuid.uuid4().hex[:8]}:"
tmp = Path(tempfile.mkdtemp(prefix="canary-real-"))
config = {"models": [{"name": "tiny", "pools": [
    {"name": "stable", "replicas": [{"url": FP32, "name": "fp32"}]},
    {"name": "bf16", "shadow_of": "stable", "sample": 1.0, "replicas": [{"url": BF16, "name": "bf16"}]},
    {"name": "self", "shadow_of": "stable", "sample": 1.0, "replicas": [{"url": FP32, "name": "fp32-self"}]}]}],
    "admin_token": TOKEN, "redis_url": SHARED_URL, "redis_key_prefix": prefix,
    "health": {"interval": 2, "timeout": 5}, "timeouts": {"first_token": 120, "total": 300},
    "canary": {"samples_sync_interval": 0.5, "check_every": 5, "judge": {"min_samples": 50}}}

def prometheus(gws):
    cfg = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
           "scrape_configs": [{"job_name": "llm-gateway", "static_configs": [{"targets": [g.split("//")[1] for g in gws]}]}]}
    (tmp / "prom.yml").write_text(yaml.safe_dump(cfg))
    port = free_port()
    proc = subprocess.Popen(["prometheus", f"--config.file={tmp/'prom.yml'}", f"--storage.tsdb.path={tmp/'data'}",
                             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_ready(url + "/-/ready", 60, proc)
    return proc, url

TOPICS = ["gateways", "the sea", "prime numbers", "bread", "rivers", "old castles", "bees", "trains",
          "winter", "chess", "volcanoes", "music", "maps", "clocks", "the moon", "gardens"]

def one(gws, i):
    gw = gws[i % 2]                      # alternate instances
    stream = (i // 2) % 2 == 0          # half streamed, half whole
    chat = (i // 4) % 2 == 0
    text = f"Write about {TOPICS[i % len(TOPICS)]}, note {i}."
    body = {"model": "tiny", "max_tokens": 24, "temperature": 0, "stream": stream}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body.update({"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text})
    if stream:
        with httpx.stream("POST", gw + path, json=body, timeout=300) as r:
            assert r.status_code == 200, r.read()
            r.read()
    else:
        r = httpx.post(gw + path, json=body, timeout=300)
        assert r.status_code == 200, r.text

def cli(*args):
    d = subprocess.run([sys.executable, "-m", "gateway", "canary", "report", "--model", "tiny", *args],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    return d.returncode, d.stdout + d.stderr

try:
    with gateway_server(tmp, config) as (g1, _), gateway_server(tmp, config) as (g2, _):
        prom_proc, prom = prometheus([g1, g2])
        try:
            t0 = time.time()
            with concurrent.futures.ThreadPoolExecutor(4) as ex:
                list(ex.map(lambda i: one([g1, g2], i), range(N)))
            print(f"{N} requests in {time.time()-t0:.0f}s", flush=True)
            # every copy ended: compared + dropped, over both instances, per shadow pool
            deadline = time.time() + 300
            while True:
                acc = {}
                for g in (g1, g2):
                    for pool, c in httpx.get(f"{g}/admin/canary/tiny/disagreements", headers=AUTH).json()["pools"].items():
                        a = acc.setdefault(pool, {"compared": 0, "greedy_compared": 0, "agreed": 0, "greedy_agreed": 0, "dropped": {}})
                        for k in ("compared", "greedy_compared", "agreed", "greedy_agreed"):
                            a[k] += c[k]
                        for k, v in c["dropped"].items():
                            a["dropped"][k] = a["dropped"].get(k, 0) + v
                ended = {p: a["compared"] + sum(a["dropped"].values()) for p, a in acc.items()}
                if all(ended.get(p) == N for p in ("bf16", "self")) or time.time() > deadline:
                    break
                time.sleep(1)
            print("pairs per shadow pool (both instances):", json.dumps(acc), "ended:", ended, flush=True)
            skipped = [l for g in (g1, g2) for l in httpx.get(g + "/metrics").text.splitlines()
                       if l.startswith("llm_gateway_shadow_skipped_total{") and not l.endswith(" 0.0")]
            print("shadow skipped:", skipped, flush=True)
            # prometheus has scraped everything
            deadline = time.time() + 60
            while time.time() < deadline:
                got = httpx.get(prom + "/api/v1/query", params={"query": 'sum(llm_gateway_shadow_pairs_total{pool="bf16"}) + sum(llm_gateway_shadow_pairs_dropped_total{pool="bf16"})'}).json()["data"]["result"]
                if got and float(got[0]["value"][1]) == ended.get("bf16"):
                    break
                time.sleep(1)
            time.sleep(3)
            results = {}
            for name, args in [("bf16_floor_g1", ("--canary", "bf16", "--gateway", g1)),
                               ("bf16_floor_g2", ("--canary", "bf16", "--gateway", g2)),
                               ("bf16_ref_g1", ("--canary", "bf16", "--reference", "self", "--gateway", g1)),
                               ("self_floor_g2", ("--canary", "self", "--gateway", g2))]:
                code, out = cli(*args, "--admin-token", TOKEN, "--window", "30m")
                codej, outj = cli(*args, "--admin-token", TOKEN, "--window", "30m", "--json")
                results[name] = json.loads(outj)
                print(f"\n=== {name} (exit {code}) ===\n{out}", flush=True)
            for name, args in [("bf16_floor_prom", ("--canary", "bf16")),
                               ("bf16_ref_prom", ("--canary", "bf16", "--reference", "self")),
                               ("self_floor_prom", ("--canary", "self"))]:
                code, out = cli(*args, "--baseline", "stable", "--prometheus", prom, "--window", "30m")
                print(f"\n=== {name} (exit {code}) ===\n{out}", flush=True)
            a, b = results["bf16_floor_g1"], results["bf16_floor_g2"]
            print("\nequal across instances:", a["requests"] == b["requests"], a["verdict"] == b["verdict"],
                  a["samples"], b["samples"], flush=True)
            (tmp / "results.json").write_text(json.dumps(results, indent=1))
        finally:
            stop(prom_proc)
finally:
    delete_prefix(SHARED_URL, prefix)
