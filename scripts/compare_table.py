#!/usr/bin/env python3
"""Turns the JSON that scripts/compare wrote into the markdown table of `make compare`.

Time outside the model = p50 latency at concurrency 1 minus the server-reported median
model time (both servers send Server-Timing), i.e. decode, pre/post-processing, encode and
HTTP of one request on an otherwise idle server.
"""
import json
import platform
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

out = Path(sys.argv[1])


def point(name: str, stem: str, label: str) -> dict:
    return next(p for p in json.loads((out / f"{name}-{stem}.json").read_text()) if p["point"] == label)


def cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def ratio(a: float, b: float, fmt: str = ".2f") -> str:
    return f"{a / b:{fmt}}" if b > 0 else "n/a"


limit = json.loads((out / "ort-limit.json").read_text())
cores = subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip()
print(f"# celer vs the Python reference handler ({datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC)\n")
print(f"Machine: {cores} cores ({cpu()}), no GPU. Model: U2NetP on ONNX Runtime CPU. "
      f"Load: `celer bench http`, closed loop, concurrency 1 and 4.\n")
for stem in ["photo-1920x1080", "photo-320x320"]:
    print(f"## {stem}.jpg\n")
    print("| server | c=1 req/s | c=1 p50 ms | c=1 p99 ms | c=4 req/s | c=4 p50 ms | c=4 p99 ms "
          "| model ms (c=1) | outside model ms (c=1) |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = {}
    for name in ["python", "celer"]:
        c1, c4 = point(name, stem, "c=1"), point(name, stem, "c=4")
        model = c1["server_stages_ms"].get("model", 0.0)
        outside = c1["latency_ms"]["p50"] - model
        rows[name] = (c1, c4, outside)
        print(f"| {name} | {c1['throughput_rps']:.2f} | {c1['latency_ms']['p50']:.1f} | {c1['latency_ms']['p99']:.1f} "
              f"| {c4['throughput_rps']:.2f} | {c4['latency_ms']['p50']:.1f} | {c4['latency_ms']['p99']:.1f} "
              f"| {model:.1f} | {outside:.1f} |")
    (p1, p4, po), (c1, c4, co) = rows["python"], rows["celer"]
    print()
    print(f"- throughput at c=4: celer / python = **{ratio(c4['throughput_rps'], p4['throughput_rps'])}x**")
    print(f"- p99 at c=4: celer / python = **{ratio(c4['latency_ms']['p99'], p4['latency_ms']['p99'])}x**")
    print(f"- time outside the model: celer / python = **{ratio(co, po, '.3f')}** ({co:.1f} ms vs {po:.1f} ms)")
    print(f"- celer c=4 throughput / ONNX Runtime alone ({limit['model_runs_per_s']:.2f} runs/s, "
          f"{limit['replicas']} x {limit['threads_per_replica']} threads) = "
          f"**{ratio(c4['throughput_rps'], limit['model_runs_per_s'])}**")
    errors = {n: sum(r[0]["errors"].values()) + sum(r[1]["errors"].values()) for n, r in rows.items()}
    print(f"- errors: {errors}\n")
