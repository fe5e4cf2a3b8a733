#!/usr/bin/env python3
"""`make soak`: drives a release `celer serve` (U2NetP) for --minutes at about 80 % of its
measured capacity, mixing valid photos of several sizes with hostile requests, and
reports per interval: RSS, answers by status (or client exception), latency percentiles
of the 200s. Ends with the issue's checks: RSS at the end within 10 % of RSS after
warm-up, no 5xx but 503, p99 of the last interval within 20 % of the first.

Capacity: closed-loop clients (as many as the server admits without queueing long)
send the same mix for --warmup-s; the 200s per second are the capacity. Then arrivals
are open-loop (Poisson) at --load x capacity.

Hostile mix (each a fraction of arrivals): a truncated JPEG (400 truncated_image),
random bytes (415), a body over the 6 MiB limit (413), a stalled upload (408 or closed
at the body limit), a wrong content type (415).
"""

import argparse
import asyncio
import json
import random
import sys
import time

from served import Server, percentile, photo

SIZES = [(320, 320), (1024, 768), (1920, 1080)]


def build_mix():
    photos = [photo(w, h) for w, h in SIZES]
    big = photos[2]
    hostile = {
        "truncated": (big[: len(big) * 2 // 3], "image/jpeg"),
        "garbage": (random.Random(1).randbytes(50_000), "image/jpeg"),
        "too_large": (b"\xff" * (7 << 20), "image/jpeg"),
        "wrong_type": (photos[0], "text/plain"),
    }
    return photos, hostile


async def post(session, url, body, ctype):
    import aiohttp

    t = time.monotonic()
    try:
        async with session.post(url, data=body, headers={"Content-Type": ctype}) as r:
            await r.read()
            return str(r.status), time.monotonic() - t
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
        return type(e).__name__, time.monotonic() - t


async def stalled_upload(host, port):
    """A head declaring 100 KB and 1 KB of body, then silence, until the server answers."""
    try:
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(
            f"POST /invocations HTTP/1.1\r\nHost: {host}\r\nContent-Type: image/jpeg\r\n"
            f"Content-Length: 100000\r\n\r\n".encode()
            + b"\xff" * 1024
        )
        await writer.drain()
        data = await asyncio.wait_for(reader.read(4096), 120)
        writer.close()
        return ("stalled_" + data[9:12].decode()) if data.startswith(b"HTTP/1.1 ") else "stalled_closed"
    except (OSError, asyncio.TimeoutError) as e:
        return "stalled_" + type(e).__name__


async def capacity(url, photos, seconds, clients):
    import aiohttp

    ok = 0
    until = time.monotonic() + seconds

    async def client(session, i):
        nonlocal ok
        n = i
        while time.monotonic() < until:
            status, _ = await post(session, url, photos[n % len(photos)], "image/jpeg")
            n += 1
            if status == "200":
                ok += 1
            elif status == "503":
                await asyncio.sleep(0.05)

    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        started = time.monotonic()
        await asyncio.gather(*(client(s, i) for i in range(clients)))
        return ok / (time.monotonic() - started)


async def soak(a, server, photos, hostile):
    import aiohttp

    url = server.url + "/invocations"
    host, port = "127.0.0.1", server.port
    idle_rss = server.rss_mb()
    cap = await capacity(url, photos, a.warmup_s, a.clients)
    rss_after_warmup = server.rss_mb()
    rate = cap * a.load
    print(f"soak: capacity {cap:.2f}/s, arrivals at {rate:.2f}/s for {a.minutes} min", file=sys.stderr)

    intervals = []
    current = {"counts": {}, "lat": [], "rss": []}
    rng = random.Random(7)
    tasks = set()
    limit = asyncio.Semaphore(a.max_outstanding)
    kinds = list(hostile) + ["stalled"]

    async def one(session):
        async with limit:
            if rng.random() < a.hostile:
                kind = rng.choice(kinds)
                if kind == "stalled":
                    key = await stalled_upload(host, port)
                else:
                    body, ctype = hostile[kind]
                    status, _ = await post(session, url, body, ctype)
                    key = f"{kind}_{status}"
                bucket = current
                bucket["counts"][key] = bucket["counts"].get(key, 0) + 1
                return
            body = photos[rng.randrange(len(photos))]
            bucket = current
            status, took = await post(session, url, body, "image/jpeg")
            bucket["counts"][status] = bucket["counts"].get(status, 0) + 1
            if status == "200":
                bucket["lat"].append(took)

    timeout = aiohttp.ClientTimeout(total=120)
    connector = aiohttp.TCPConnector(limit=a.max_outstanding)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        started = time.monotonic()
        end = started + a.minutes * 60
        next_interval = started + a.interval_s
        next_arrival = started
        while time.monotonic() < end:
            now = time.monotonic()
            if now >= next_interval:
                current["rss"].append(server.rss_mb())
                intervals.append(current)
                report(len(intervals), current, a.interval_s)
                current = {"counts": {}, "lat": [], "rss": []}
                next_interval += a.interval_s
            if now >= next_arrival:
                t = asyncio.create_task(one(session))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
                next_arrival += rng.expovariate(rate)
                continue
            await asyncio.sleep(min(next_arrival, next_interval) - now)
        await asyncio.gather(*tasks)
        current["rss"].append(server.rss_mb())
        if current["counts"]:
            intervals.append(current)
            report(len(intervals), current, a.interval_s)

    await asyncio.sleep(a.settle_s)
    return {
        "capacity_per_s": cap,
        "arrivals_per_s": rate,
        "minutes": a.minutes,
        "idle_rss_mb": idle_rss,
        "rss_after_warmup_mb": rss_after_warmup,
        "rss_end_mb": intervals[-1]["rss"][-1],
        f"rss_{a.settle_s}s_after_load_mb": server.rss_mb(),
        "peak_rss_mb": server.peak_rss_mb(),
        "intervals": [summary(i) for i in intervals],
    }


def summary(interval):
    lat = sorted(interval["lat"])
    return {
        "counts": interval["counts"],
        "ok": len(lat),
        "p50_s": percentile(lat, 50),
        "p90_s": percentile(lat, 90),
        "p99_s": percentile(lat, 99),
        "rss_mb": interval["rss"][-1] if interval["rss"] else None,
    }


def report(n, interval, seconds):
    s = summary(interval)
    p = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    print(
        f"soak: interval {n} ({seconds} s): rss {s['rss_mb']:.0f} MB, p50 {p(s['p50_s'])} "
        f"p90 {p(s['p90_s'])} p99 {p(s['p99_s'])} s, {json.dumps(s['counts'], sort_keys=True)}",
        file=sys.stderr,
        flush=True,
    )


def checks(result):
    misses = []
    end, warm = result["rss_end_mb"], result["rss_after_warmup_mb"]
    if end > warm * 1.10:
        misses.append(f"RSS at the end {end:.0f} MB > 110 % of {warm:.0f} MB after warm-up")
    for i, interval in enumerate(result["intervals"]):
        for key, n in interval["counts"].items():
            code = key.rsplit("_", 1)[-1]
            if code.isdigit() and code.startswith("5") and code != "503":
                misses.append(f"interval {i + 1}: {n} x {key}")
    first, last = result["intervals"][0]["p99_s"], result["intervals"][-1]["p99_s"]
    if first and last and last > first * 1.2:
        misses.append(f"p99 of the last interval {last:.3f} s > 120 % of the first {first:.3f} s")
    return misses


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=30)
    p.add_argument("--interval-s", type=float, default=60)
    p.add_argument("--warmup-s", type=float, default=30)
    p.add_argument("--settle-s", type=int, default=10)
    p.add_argument("--load", type=float, default=0.8, help="arrivals as a fraction of capacity")
    p.add_argument("--hostile", type=float, default=0.1, help="fraction of hostile arrivals")
    p.add_argument("--clients", type=int, default=4, help="closed-loop clients measuring capacity")
    p.add_argument("--max-outstanding", type=int, default=256)
    p.add_argument("--log", help="the server's log file")
    a = p.parse_args()
    photos, hostile = build_mix()
    with Server(log=a.log) as server:
        result = asyncio.run(soak(a, server, photos, hostile))
    result["misses"] = checks(result)
    json.dump(result, sys.stdout, indent=1)
    print()
    if result["misses"]:
        sys.exit("soak: " + "; ".join(result["misses"]))


if __name__ == "__main__":
    main()
