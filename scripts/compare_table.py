#!/usr/bin/env python3
"""Turns the JSON that scripts/compare wrote (one folder per round) into the markdown
table of `make compare`: the median of each figure over the rounds, and the ratios the
README quotes, each computed within a round (same machine state) and then its median.

Time outside the model = p50 latency at concurrency 1 minus the server-reported median
model time (both servers send Server-Timing): decode, pre/post-processing, encode and HTTP
of one request on an otherwise idle server. ONNX Runtime alone: the model back to back in
each layout (`celer bench local --model-only`) at the start of the round, its solo
layout's run time the model time a lone request can get; its best layout again in the
slices around the servers' c=4 slices (`scripts/compare`), its rate the limit under load.
A c=4 figure of a round is the median over its slices; a ratio against ONNX Runtime alone
divides each server slice by the mean of the two ONNX Runtime slices either side of it.
Result folders from before the slices (one c=4 file per server, ONNX Runtime alone before
and after the points) still read.

CPU per request at c=4: the server process's CPU time (all threads) over the requests it
completed, and the load generator's, on the same cores (`bench http --server-pid`); ONNX
Runtime's CPU per run in its best layout. With the cores saturated, throughput is the
cores' time over the CPU per request, so the ratio of the two CPU figures is the bound on
the throughput ratio that the work around the model sets.
"""
import json
import os
import math
import platform
import statistics
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

# The server celer is compared with: the Python handler, or (`BASELINE=...` in
# scripts/compare) another celer binary, named `before`.
REF = os.environ.get("COMPARE_REFERENCE", "python")
TITLE = "the Python reference handler" if REF == "python" else f"another build ({REF})"

out = Path(sys.argv[1])
rounds = sorted(p for p in out.glob("round-*") if p.is_dir())
if not rounds:
    sys.exit(f"compare_table: no round-* folders in {out}")
STEMS = ["photo-320x320", "photo-1920x1080"]
# celer on the FP32 model, and on the INT8 variant where the run had one (runs before
# the INT8 variant had two servers).
INT8 = "celer-int8"
HAS_INT8 = any(rounds[0].glob(f"{INT8}-*.json"))
NAMES = [REF, "celer"] + ([INT8] if HAS_INT8 else [])


def point_in(path: Path, label: str) -> dict:
    """The point `label` (`c=1`, `c=4`) of a `bench http --json` file."""
    return next(p for p in json.loads(path.read_text()) if p["point"] == label)


def point(rnd: Path, name: str, stem: str, label: str) -> dict:
    """One point (`c=1`, `c=4`) of one server on one image: a file each (at c=1 one
    client took turns between the two servers; at c=4 each was loaded in turn)."""
    return point_in(rnd / f"{name}-{stem}-{label.replace('=', '')}.json", label)


def slice_files(rnd: Path, prefix: str) -> list:
    """A round's files `<prefix>-<i>.json`, in slice order."""
    return sorted(rnd.glob(f"{prefix}-*.json"), key=lambda f: int(f.stem.rsplit("-", 1)[1]))


def c4_slices(rnd: Path, name: str, stem: str) -> list:
    """A server's c=4 points in one round: one per slice (`-c4-1.json`, ...), or the one
    point of a round measured before the slices."""
    files = slice_files(rnd, f"{name}-{stem}-c4")
    if not files:
        return [point(rnd, name, stem, "c=4")]
    return [point_in(f, "c=4") for f in files]


def ort_beside(rnd: Path, stem: str, o: dict) -> list:
    """ONNX Runtime alone beside each c=4 slice of one round: for slice i the mean of the
    best layout's slices i and i+1 (`ort-<stem>-c4-<i>.json`), as (runs/s, CPU ms per
    run). A round measured before the slices had one c=4 point per server: the round's
    best layout, once."""
    files = slice_files(rnd, f"ort-{stem}-c4")
    if not files:
        best = o["best"]
        return [(best["runs_per_s"], cpu_per_run(best))]
    rates = [json.loads(f.read_text())["best"] for f in files]
    return [
        (
            statistics.mean([a["runs_per_s"], b["runs_per_s"]]),
            statistics.mean([cpu_per_run(a), cpu_per_run(b)]),
        )
        for a, b in zip(rates, rates[1:])
    ]


def cpu_per_run(layout: dict) -> float:
    return layout.get("cpu_ms_per_run") or float("nan")


def cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def med(values) -> float:
    """The median of the figures recorded (NaN marks one that was not; NaN if none was)."""
    present = [v for v in values if not math.isnan(v)]
    return statistics.median(present) if present else float("nan")


def server_cpu(c4: dict) -> float:
    """A c=4 point's server CPU per request (NaN, which the medians skip, where it was not
    recorded)."""
    return c4.get("server_cpu_ms_per_request") or float("nan")


def figures(rnd: Path, name: str, stem: str, c4: list) -> dict:
    """One server's figures on one image in one round, its c=4 slices `c4` as medians."""
    c1 = point(rnd, name, stem, "c=1")
    model = c1["server_stages_ms"].get("model", 0.0)
    return {
        "c1_rps": c1["throughput_rps"],
        "c1_p50": c1["latency_ms"]["p50"],
        "c1_p99": c1["latency_ms"]["p99"],
        "c4_rps": med(p["throughput_rps"] for p in c4),
        "c4_p50": med(p["latency_ms"]["p50"] for p in c4),
        "c4_p99": med(p["latency_ms"]["p99"] for p in c4),
        "model": model,
        "outside": c1["latency_ms"]["p50"] - model,
        "c4_server_cpu": med(server_cpu(p) for p in c4),
        "c4_client_cpu": med(p.get("client_cpu_ms_per_request") or float("nan") for p in c4),
        "errors": sum(c1["errors"].values()) + sum(sum(p["errors"].values()) for p in c4),
    }




def ort_limit(rnd: Path) -> dict:
    """ONNX Runtime alone in each layout in one round (`ort-limit.json`). A round of
    2026-12-02 before the slices measured it before the servers' points and after them
    (`ort-limit-before.json`, `ort-limit-after.json`): each layout's figures the mean of
    the two, the best layout the fastest of those means."""
    names = ("ort-limit-before.json", "ort-limit-after.json")
    runs = [json.loads((rnd / n).read_text()) for n in names if (rnd / n).exists()]
    if not runs:
        return json.loads((rnd / "ort-limit.json").read_text())
    layouts = []
    for first in runs[0]["layouts"]:
        rows = [next(l for l in r["layouts"] if l["layout"] == first["layout"]) for r in runs]
        merged = dict(first)
        for key in ("runs_per_s", "run_p50_ms", "cpu_ms_per_run", "mapped_mb_per_run"):
            present = [r[key] for r in rows if r.get(key) is not None]
            merged[key] = statistics.mean(present) if present else None
        layouts.append(merged)
    best = max(layouts, key=lambda l: l["runs_per_s"])
    return {"cores": runs[0]["cores"], "layouts": layouts, "best": best}


ort = [ort_limit(r) for r in rounds]
cores = subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip()
print(f"# celer vs {TITLE} ({datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC)\n")
print(
    f"Machine: {cores} cores ({cpu()}), no GPU. Model: U2NetP on ONNX Runtime CPU"
    + (f" (`celer` on the FP32 model, `{INT8}` on the INT8 variant of `make int8`)" if HAS_INT8 else "")
    + ". "
    f"Load: `celer bench http`, closed loop: at concurrency 1 one client taking turns "
    f"between the servers (a request to each in order), at 4 each server in turn, in "
    f"slices between slices of ONNX Runtime alone in its best layout. Medians of "
    f"{len(rounds)} rounds; each ratio is taken within a round (at c=4 within a slice and "
    f"its neighbours, then the median of the round's slices), then its median.\n"
)

print("## ONNX Runtime alone on the model\n")
print("| layout | sessions | threads each | runs/s | run p50 ms | CPU ms per run |")
print("|---|---|---|---|---|---|")
layouts = [l["layout"] for l in ort[0]["layouts"]]
for name in layouts:
    rows = [next(l for l in o["layouts"] if l["layout"] == name) for o in ort]
    print(
        f"| {name} | {rows[0]['sessions']} | {rows[0]['threads']} "
        f"| {med(r['runs_per_s'] for r in rows):.2f} | {med(r['run_p50_ms'] for r in rows):.1f} "
        f"| {med(cpu_per_run(r) for r in rows):.1f} |"
    )
bests = [o["best"]["layout"] for o in ort]
print(f"\nBest layout under load, by round: {', '.join(bests)}.\n")

summary = {}
for stem in STEMS:
    # Each round's c=4 slices per server, and its figures.
    slices = [{n: c4_slices(r, n, stem) for n in NAMES} for r in rounds]
    per_round = [
        {n: figures(r, n, stem, sl[n]) for n in NAMES}
        for r, sl in zip(rounds, slices)
    ]
    print(f"## {stem}.jpg\n")
    print(
        "| server | c=1 p50 ms | c=1 p99 ms | c=1 req/s | c=4 req/s | c=4 p50 ms | c=4 p99 ms "
        "| model ms (c=1) | outside model ms (c=1) | server CPU ms/req (c=4) "
        "| client CPU ms/req (c=4) | errors |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in NAMES:
        f = {k: med(pr[name][k] for pr in per_round) for k in per_round[0][name]}
        print(
            f"| {name} | {f['c1_p50']:.1f} | {f['c1_p99']:.1f} | {f['c1_rps']:.2f} | {f['c4_rps']:.2f} "
            f"| {f['c4_p50']:.1f} | {f['c4_p99']:.1f} | {f['model']:.1f} | {f['outside']:.1f} "
            f"| {f['c4_server_cpu']:.1f} | {f['c4_client_cpu']:.1f} "
            f"| {sum(pr[name]['errors'] for pr in per_round)} |"
        )

    beside = [ort_beside(r, stem, o) for r, o in zip(rounds, ort)]

    def within(fn, *args) -> float:
        # A figure of 0 (nothing answered within a window shorter than a request)
        # makes no ratio: NaN, which the median skips.
        try:
            return fn(*args)
        except ZeroDivisionError:
            return float("nan")

    def ratio(fn):
        values = [within(fn, pr, o) for pr, o in zip(per_round, ort)]
        return med(values), values

    def sliced(fn):
        """A ratio of slice i's figures (the servers' points and ONNX Runtime beside
        them): its median over a round's slices, then over the rounds."""
        values = [
            med(within(fn, sl, b, i) for i in range(len(sl["celer"])))
            for sl, b in zip(slices, beside)
        ]
        return med(values), values

    ratios = {
        f"c=1 p50, celer / {REF}" + (" (target <= 0.8)" if REF == "python" else ""): ratio(
            lambda pr, o: pr["celer"]["c1_p50"] / pr[REF]["c1_p50"]
        ),
        f"c=4 throughput, celer / {REF}": sliced(
            lambda sl, b, i: sl["celer"][i]["throughput_rps"] / sl[REF][i]["throughput_rps"]
        ),
        "c=4 throughput, celer / ONNX Runtime alone, best layout (target >= 0.9)": sliced(
            lambda sl, b, i: sl["celer"][i]["throughput_rps"] / b[i][0]
        ),
        "c=1 model time, celer / ONNX Runtime alone, solo layout": ratio(
            lambda pr, o: pr["celer"]["model"]
            / next(l for l in o["layouts"] if l["layout"] == "solo")["run_p50_ms"]
        ),
        "c=4 CPU per request, celer server / ONNX Runtime alone per run, best layout": sliced(
            lambda sl, b, i: server_cpu(sl["celer"][i]) / b[i][1]
        ),
        f"time outside the model at c=1, celer / {REF}": ratio(
            lambda pr, o: pr["celer"]["outside"] / pr[REF]["outside"]
        ),
    }
    if HAS_INT8:
        ratios.update({
            f"c=4 throughput, {INT8} / ONNX Runtime alone on the FP32 model, best layout (target >= 1.8)": sliced(
                lambda sl, b, i: sl[INT8][i]["throughput_rps"] / b[i][0]
            ),
            f"c=1 p50, {INT8} / {REF}" + (" (target <= 0.6 at 320x320)" if REF == "python" else ""): ratio(
                lambda pr, o: pr[INT8]["c1_p50"] / pr[REF]["c1_p50"]
            ),
            f"c=4 throughput, {INT8} / {REF}": sliced(
                lambda sl, b, i: sl[INT8][i]["throughput_rps"] / sl[REF][i]["throughput_rps"]
            ),
            f"c=4 throughput, {INT8} / celer (FP32)": sliced(
                lambda sl, b, i: sl[INT8][i]["throughput_rps"] / sl["celer"][i]["throughput_rps"]
            ),
            f"c=1 model time, {INT8} / celer (FP32)": ratio(
                lambda pr, o: pr[INT8]["model"] / pr["celer"]["model"]
            ),
            f"c=4 CPU per request, {INT8} server / ONNX Runtime alone per FP32 run, best layout": sliced(
                lambda sl, b, i: server_cpu(sl[INT8][i]) / b[i][1]
            ),
        })
    print()
    for label, (m, values) in ratios.items():
        print(f"- {label}: **{m:.2f}** (rounds: {', '.join(f'{v:.2f}' for v in values)})")
    print()
    summary[stem] = {label: m for label, (m, _) in ratios.items()}

(out / "summary.json").write_text(json.dumps(summary, indent=2))
