#!/usr/bin/env python3
"""Real Python HTTP clients against a running celer server, for the hardening tests
(tests/hostile.rs) and the figures (scripts/hostile): each mode prints one JSON object.

  early URL --client requests|urllib3|httpclient|aiohttp --bytes N [--content-type T] [--repeat K]
      POST N bytes and report what the client saw: the status and JSON code of each
      answer, or the exception the client raised instead (a reset, a broken pipe).
  stall URL --connections N --declared D --sent S --normal-image FILE [--normal-type T]
      Open N connections that each send a head declaring D bytes and S bytes of body, then
      stop; while they are held, time one normal request (requests); then wait for each
      stalled connection's answer or close, timing it.
  flood URL --image FILE --clients C --seconds T
      C closed-loop aiohttp clients for T seconds: counts by status (and by exception),
      latency percentiles of the 200s.
"""

import argparse
import asyncio
import json
import socket
import sys
import threading
import time


def describe(exc):
    return f"{type(exc).__name__}: {exc}"


def early_requests(url, body, ctype, repeat):
    import requests

    out = []
    with requests.Session() as s:
        for _ in range(repeat):
            try:
                r = s.post(url, data=body, headers={"Content-Type": ctype}, timeout=60)
                out.append(answer(r.status_code, r.content))
            except Exception as e:  # noqa: BLE001 - the point is to report it
                out.append({"exception": describe(e)})
    return out


def early_urllib3(url, body, ctype, repeat):
    import urllib3

    out = []
    pool = urllib3.PoolManager(retries=False)
    for _ in range(repeat):
        try:
            r = pool.request("POST", url, body=body, headers={"Content-Type": ctype}, timeout=60)
            out.append(answer(r.status, r.data))
        except Exception as e:  # noqa: BLE001
            out.append({"exception": describe(e)})
    return out


def early_httpclient(url, body, ctype, repeat):
    import http.client
    import urllib.parse

    u = urllib.parse.urlsplit(url)
    out = []
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    for _ in range(repeat):
        try:
            conn.request("POST", u.path, body=body, headers={"Content-Type": ctype})
            r = conn.getresponse()
            out.append(answer(r.status, r.read()))
            if r.will_close:
                conn.close()
        except Exception as e:  # noqa: BLE001
            out.append({"exception": describe(e)})
            conn.close()
    conn.close()
    return out


def early_aiohttp(url, body, ctype, repeat):
    import aiohttp

    async def run():
        out = []
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(timeout=timeout) as s:
            for _ in range(repeat):
                try:
                    async with s.post(url, data=body, headers={"Content-Type": ctype}) as r:
                        out.append(answer(r.status, await r.read()))
                except Exception as e:  # noqa: BLE001
                    out.append({"exception": describe(e)})
        return out

    return asyncio.run(run())


def answer(status, content):
    a = {"status": status}
    try:
        a["code"] = json.loads(content).get("code")
    except Exception:  # noqa: BLE001 - a PNG, or not JSON
        a["bytes"] = len(content)
    return a


CLIENTS = {
    "requests": early_requests,
    "urllib3": early_urllib3,
    "httpclient": early_httpclient,
    "aiohttp": early_aiohttp,
}


def cmd_early(a):
    body = b"\xab" * a.bytes
    answers = CLIENTS[a.client](a.url, body, a.content_type, a.repeat)
    return {"client": a.client, "answers": answers}


def cmd_stall(a):
    import urllib.parse

    import requests

    u = urllib.parse.urlsplit(a.url)
    head = (
        f"POST {u.path} HTTP/1.1\r\nHost: {u.hostname}:{u.port}\r\n"
        f"Content-Type: image/jpeg\r\nContent-Length: {a.declared}\r\n\r\n"
    ).encode()
    socks = []
    t0 = time.monotonic()
    for _ in range(a.connections):
        s = socket.create_connection((u.hostname, u.port), timeout=120)
        s.sendall(head + b"\xff" * a.sent)
        socks.append(s)
    opened = time.monotonic() - t0
    results = [None] * len(socks)

    def watch(i, s):
        started = time.monotonic()
        data = b""
        try:
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
        except OSError as e:
            results[i] = {"exception": describe(e), "after_s": time.monotonic() - started}
            return
        status = None
        if data.startswith(b"HTTP/1.1 "):
            status = int(data[9:12])
        code = None
        if b"\r\n\r\n" in data:
            try:
                code = json.loads(data.split(b"\r\n\r\n", 1)[1]).get("code")
            except Exception:  # noqa: BLE001
                pass
        results[i] = {"status": status, "code": code, "after_s": time.monotonic() - started}

    threads = [threading.Thread(target=watch, args=(i, s)) for i, s in enumerate(socks)]
    for t in threads:
        t.start()
    normal = []
    image = open(a.normal_image, "rb").read()
    for _ in range(a.normal):
        t = time.monotonic()
        try:
            r = requests.post(
                a.url, data=image, headers={"Content-Type": a.normal_type}, timeout=60
            )
            normal.append({"status": r.status_code, "seconds": time.monotonic() - t})
        except Exception as e:  # noqa: BLE001
            normal.append({"exception": describe(e), "seconds": time.monotonic() - t})
    held_while_normal = sum(1 for r in results if r is None)
    for t in threads:
        t.join()
    for s in socks:
        s.close()
    return {
        "opened_s": opened,
        "normal": normal,
        "stalled_still_open_after_normal": held_while_normal,
        "stalled": results,
    }


def cmd_flood(a):
    import aiohttp

    image = open(a.image, "rb").read()
    counts = {}
    latencies = []

    async def client(session, until):
        while time.monotonic() < until:
            t = time.monotonic()
            try:
                async with session.post(
                    a.url, data=image, headers={"Content-Type": a.content_type}
                ) as r:
                    await r.read()
                    key = str(r.status)
                    if r.status == 200:
                        latencies.append(time.monotonic() - t)
                    elif r.status == 503 and a.backoff:
                        await asyncio.sleep(float(r.headers.get("Retry-After", "1")))
            except Exception as e:  # noqa: BLE001
                key = type(e).__name__
            counts[key] = counts.get(key, 0) + 1

    async def run():
        timeout = aiohttp.ClientTimeout(total=120)
        connector = aiohttp.TCPConnector(limit=a.clients)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as s:
            until = time.monotonic() + a.seconds
            await asyncio.gather(*(client(s, until) for _ in range(a.clients)))

    started = time.monotonic()
    asyncio.run(run())
    elapsed = time.monotonic() - started
    latencies.sort()

    def pct(p):
        if not latencies:
            return None
        return latencies[min(len(latencies) - 1, int(p / 100 * len(latencies)))]

    return {
        "clients": a.clients,
        "seconds": elapsed,
        "counts": counts,
        "ok": len(latencies),
        "ok_per_s": len(latencies) / elapsed,
        "p50_s": pct(50),
        "p90_s": pct(90),
        "p99_s": pct(99),
        "max_s": latencies[-1] if latencies else None,
    }


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("early")
    e.add_argument("url")
    e.add_argument("--client", choices=sorted(CLIENTS), required=True)
    e.add_argument("--bytes", type=int, required=True)
    e.add_argument("--content-type", default="image/jpeg")
    e.add_argument("--repeat", type=int, default=1)
    s = sub.add_parser("stall")
    s.add_argument("url")
    s.add_argument("--connections", type=int, default=200)
    s.add_argument("--declared", type=int, default=100_000)
    s.add_argument("--sent", type=int, default=1024)
    s.add_argument("--normal", type=int, default=1)
    s.add_argument("--normal-image", required=True)
    s.add_argument("--normal-type", default="image/jpeg")
    f = sub.add_parser("flood")
    f.add_argument("url")
    f.add_argument("--image", required=True)
    f.add_argument("--content-type", default="image/jpeg")
    f.add_argument("--clients", type=int, default=64)
    f.add_argument("--seconds", type=float, default=20)
    f.add_argument("--backoff", action="store_true", help="sleep Retry-After after a 503")
    a = p.parse_args()
    result = {"early": cmd_early, "stall": cmd_stall, "flood": cmd_flood}[a.cmd](a)
    json.dump(result, sys.stdout)
    print()


if __name__ == "__main__":
    main()
