"""The step-time fit of benchmarks/fit_v1_step.py on synthetic points: it recovers the terms
that made them, reports residuals per load, and reads the engine's Prometheus text as vLLM
writes it (several label sets summed)."""

from __future__ import annotations

import http.server
import threading

from benchmarks.fit_v1_step import delta, fit, least_squares, scrape


def point(load: str, kind: str, tokens: float, seqs: float, prefills: float,
          step_s: float) -> dict:
    return {"load": load, "kind": kind, "tokens_per_step": tokens, "seqs_per_step": seqs,
            "prefills_per_step": prefills, "context_per_seq": 100.0, "step_s": step_s}


def test_least_squares_recovers_known_coefficients() -> None:
    rows = [[1.0, t, s] for t, s in ((1, 1), (16, 1), (512, 1), (8, 8), (64, 60), (30, 4))]
    ys = [0.005 + 0.00003 * t + 0.0001 * s for _, t, s in rows]
    coef = least_squares(rows, ys)
    assert [round(c, 9) for c in coef] == [0.005, 0.00003, 0.0001]


def test_fit_reports_residuals_and_predicts_held_out_loads() -> None:
    step = lambda t, s: 0.005 + 0.00003 * t + 0.0001 * s  # noqa: E731
    points = [point(f"prefill {p}", "prefill", p, 1, 1, step(p, 1)) for p in (16, 256, 1000)]
    points += [point(f"decode {c}", "decode", c, c, 0.01, step(c, c)) for c in (1, 8, 64)]
    points.append(point("mixed 4", "mixed", 66, 4, 0.1, step(66, 4) * 1.1))  # 10% off the shape
    result = fit(points)["base + tokens + seqs"]
    assert result["rms_relative_residual"] < 1e-9
    assert abs(result["held_out_relative_errors"][0] - (1 / 1.1 - 1)) < 1e-9
    assert set(result["relative_residuals"]) == {p["load"] for p in points}
    assert fit(points)["base + tokens"]["rms_relative_residual"] > 0.05  # requests matter here


def test_scrape_sums_label_sets_of_the_series_it_reads() -> None:
    text = (b'# HELP vllm:iteration_tokens_total x\n'
            b'vllm:iteration_tokens_total_count{engine="0",model_name="tiny"} 10.0\n'
            b'vllm:iteration_tokens_total_count{engine="1",model_name="tiny"} 5.0\n'
            b'vllm:iteration_tokens_total_sum{engine="0",model_name="tiny"} 300.0\n'
            b'vllm:generation_tokens_total{engine="0",model_name="tiny"} 42.0\n'
            b'vllm:iteration_tokens_total_bucket{engine="0",le="1.0"} 3.0\n')

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(text)

        def log_message(self, *args) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        got = scrape(f"http://127.0.0.1:{server.server_port}")
    finally:
        server.shutdown()
    assert got["vllm:iteration_tokens_total_count"] == 15.0
    assert got["vllm:iteration_tokens_total_sum"] == 300.0
    assert got["vllm:generation_tokens_total"] == 42.0
    assert got["vllm:num_preemptions_total"] == 0.0  # absent series read as 0
    assert delta(got, dict.fromkeys(got, 1.0))["vllm:generation_tokens_total"] == 41.0
