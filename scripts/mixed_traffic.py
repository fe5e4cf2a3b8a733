#!/usr/bin/env python3
"""Mixed traffic over HTTP against a CPU server, scheduling by count against by cost.

Half the requests are a 320x320 photo, half a 4032x3024 one, sent in turn by one
`celer bench http` with both as inputs (closed loop: each client sends the next request
of the sequence when its last is answered), each with the same client deadline
(`--deadline-ms`: the `deadline-ms=` custom attribute), asking for the alpha (a 12 MP
cut-out's PNG is over real-time hosting's 6 MB response limit). The bench reports each
input's percentiles, its answers slower than the deadline, and its refusals by code.
The server is started with `--scheduling count` (the estimate by count and arrival
order) and `--scheduling cost` in alternating rounds, on the same cores, both with
`--warmup-size` at the traffic's two sizes unless told otherwise (`--server-warmup`); the
medians over the rounds and their ratio are printed.

    scripts/mixed_traffic.py [--rounds 3] [--duration-s 30] [--clients 4] [--deadline-ms 10000]
                             [--output alpha|cutout]
"""

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CELER = ROOT / "target/release/celer"
PHOTOS = ROOT / "tests/data/fetched"
SIZES = {"320x320": PHOTOS / "photo-320x320.jpg", "4032x3024": PHOTOS / "photo-4032x3024.jpg"}


def get(url):
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.status, r.read().decode()


def start(scheduling, port, log, extra):
    server = subprocess.Popen(
        [str(CELER), "serve", "--model-dir", str(ROOT / "onnx/u2netp"), "--bind", "127.0.0.1",
         "--port", str(port), "--grpc-port", "0", "--scheduling", scheduling, *extra],
        stdout=log, stderr=subprocess.STDOUT,
    )
    deadline = time.time() + 120
    while time.time() < deadline:
        if server.poll() is not None:
            sys.exit(f"the {scheduling} server exited ({server.returncode}); see {log.name}")
        try:
            if get(f"http://127.0.0.1:{port}/ping")[0] == 200:
                return server
        except OSError:
            pass
        time.sleep(0.2)
    server.kill()
    sys.exit(f"the {scheduling} server did not become ready; see {log.name}")


def rejected(metrics):
    """celer_inference_request_rejected_total by reason, from /metrics."""
    out = {}
    for line in metrics.splitlines():
        if line.startswith("celer_inference_request_rejected_total{"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            out[reason] = float(line.rsplit(" ", 1)[1])
    return out


def round_of(scheduling, args, work):
    port = 18380
    with open(work / f"server-{scheduling}.log", "a") as log:
        # A 12 MP cut-out's PNG (9 MB) is over real-time hosting's 6 MB response limit.
        extra = ["--max-response-bytes", "0"] if args.output == "cutout" else []
        extra += ["--max-queue-wait", args.max_queue_wait]
        if args.server_warmup != "none":
            extra += ["--warmup-size", args.server_warmup]
        server = start(scheduling, port, log, extra)
        try:
            out = work / f"{scheduling}.json"
            inputs = [arg for photo in SIZES.values() for arg in ("--input", str(photo))]
            bench = subprocess.run(
                [str(CELER), "bench", "http", "--url", f"http://127.0.0.1:{port}", *inputs,
                 "--concurrency", str(args.clients), "--duration-s", str(args.duration_s),
                 "--warmup-s", str(args.warmup_s), "--custom-attributes", f"output={args.output}",
                 "--deadline-ms", str(args.deadline_ms), "--label", scheduling,
                 "--json", str(out), *(["--honor-retry-after"] if args.honor_retry_after else [])],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            )
            if bench.returncode != 0:
                sys.exit(f"celer bench http failed ({scheduling}):\n{bench.stdout}")
            point = json.loads(out.read_text())[0]
            by_name = {i["input"]: i for i in point["by_input"]}
            result = {size: by_name[photo.name] for size, photo in SIZES.items()}
            result["throughput_rps"] = point["throughput_rps"]
            result["rejected"] = rejected(get(f"http://127.0.0.1:{port}/metrics")[1])
            return result
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(timeout=60)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration-s", type=float, default=30)
    parser.add_argument("--warmup-s", type=float, default=5)
    parser.add_argument("--clients", type=int, default=4,
                        help="closed-loop clients (enough to keep the cores busy)")
    parser.add_argument("--deadline-ms", type=int, default=10000)
    parser.add_argument("--honor-retry-after", action="store_true",
                        help="a refused client waits the server's Retry-After before its next "
                             "request (by default it sends the next at once)")
    parser.add_argument("--max-queue-wait", default="2x",
                        help="both servers' queue budget (`celer serve --max-queue-wait`): "
                             "more clients than it admits are refused and retry at once")
    parser.add_argument("--server-warmup", default=",".join(SIZES),
                        help="both servers' `--warmup-size` (default: the traffic's two sizes, "
                             "as a deployment prepared for its traffic sets it), or none")
    parser.add_argument("--output", choices=["alpha", "cutout"], default="alpha",
                        help="what each request asks for (cutout: the server without a "
                             "response limit)")
    args = parser.parse_args()
    for path in [CELER, *SIZES.values()]:
        if not path.exists():
            sys.exit(f"{path} missing: run `make build models` first")
    work = Path(tempfile.mkdtemp(prefix="celer-mixed-"))
    runs = {"count": [], "cost": []}
    for r in range(args.rounds):
        for scheduling in ("count", "cost"):
            result = round_of(scheduling, args, work)
            runs[scheduling].append(result)
            print(f"round {r + 1} {scheduling}: " + ", ".join(
                f"{size} p50 {result[size]['latency_ms']['p50']:.0f} p99 "
                f"{result[size]['latency_ms']['p99']:.0f} ms, {result[size]['ok']} ok "
                f"({result[size]['late']} late), errors {result[size]['errors']}" for size in SIZES
            ) + f"; {result['throughput_rps']:.2f} req/s; refused by reason {result['rejected']}",
                flush=True)

    def med(scheduling, size, key):
        return statistics.median(x[size]["latency_ms"][key] for x in runs[scheduling])

    print(f"\n{os.cpu_count()} cores, {args.clients} clients, output={args.output}, "
          f"deadline-ms={args.deadline_ms}, max-queue-wait={args.max_queue_wait}, "
          f"honor-retry-after={args.honor_retry_after}, server-warmup={args.server_warmup}, "
          f"{args.duration_s:.0f} s a round, medians of {args.rounds} rounds (server logs in {work})")
    print("| scheduling | 320x320 p50 / p99 ms | 4032x3024 p50 / p99 ms | req/s | answered 200 "
          "| of them late | other answers |")
    print("|---|---|---|---|---|---|---|")
    for scheduling in ("count", "cost"):
        ok = sum(x[s]["ok"] for x in runs[scheduling] for s in SIZES)
        late = sum(x[s]["late"] for x in runs[scheduling] for s in SIZES)
        rps = statistics.median(x["throughput_rps"] for x in runs[scheduling])
        errors = {}
        for x in runs[scheduling]:
            for s in SIZES:
                for k, v in x[s]["errors"].items():
                    errors[f"{s} {k}"] = errors.get(f"{s} {k}", 0) + v
        cells = [f"{med(scheduling, s, 'p50'):.0f} / {med(scheduling, s, 'p99'):.0f}" for s in SIZES]
        print(f"| {scheduling} | {cells[0]} | {cells[1]} | {rps:.2f} | {ok} | {late} "
              f"| {errors or 'none'} |")
    def ratio(size):
        count = med("count", size, "p99")
        return f"{med('cost', size, 'p99') / count:.3f}" if count > 0 else "none (no answers)"

    print(f"\n320x320 p99, cost / count: {ratio('320x320')} (target <= 0.5); "
          f"4032x3024 p99: {ratio('4032x3024')}")


if __name__ == "__main__":
    main()
