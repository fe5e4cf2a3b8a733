#!/usr/bin/env python3
"""The hardening figures of the README (`make hostile`), measured against a release
`celer serve` (U2NetP) started here, with the clients of scripts/hostile_clients.py:

  rss     peak RSS while 4 closed-loop clients send the 1920x1080 photo (fresh server)
  stall   N uploads that send a head and 1 KB of a 100 KB body, then stop: a normal
          request's latency while they are held, against unloaded; when each stalled
          one got its answer (408) or was closed
  flood   closed-loop aiohttp clients with a 1024x768 JPEG: 4, then 64, same server:
          counts by status or exception, p99 of the 200s and its ratio
  413     a 30 MB body from Python's http.client

Prints one JSON object; `--check` exits 1 when a figure misses the issue's target.
"""

import argparse
import json
import sys
import tempfile
import time
from argparse import Namespace

import hostile_clients as hc
from served import Server, median, photo


def timed_posts(url, body, n):
    import requests

    out = []
    with requests.Session() as s:
        for _ in range(n):
            t = time.monotonic()
            r = s.post(url, data=body, headers={"Content-Type": "image/jpeg"}, timeout=60)
            r.raise_for_status()
            out.append(time.monotonic() - t)
    return out


def rss_figure(seconds, log):
    with Server(log=log) as server, tempfile.NamedTemporaryFile(suffix=".jpg") as f:
        f.write(photo(1920, 1080))
        f.flush()
        idle = server.rss_mb()
        flood = hc.cmd_flood(
            Namespace(
                url=server.url + "/invocations",
                image=f.name,
                content_type="image/jpeg",
                clients=4,
                seconds=seconds,
                backoff=False,
            )
        )
        peak = server.peak_rss_mb()
        time.sleep(5)
        return {
            "idle_rss_mb": round(idle, 1),
            "peak_rss_mb_4_clients_1080p": round(peak, 1),
            "rss_mb_5s_after": round(server.rss_mb(), 1),
            "flood": flood,
        }


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stalled", type=int, default=200)
    p.add_argument("--flood-seconds", type=float, default=20)
    p.add_argument("--rss-seconds", type=float, default=20)
    p.add_argument("--log", help="the server's log file")
    p.add_argument("--check", action="store_true", help="exit 1 when a figure misses its target")
    a = p.parse_args()

    out = {"rss": rss_figure(a.rss_seconds, a.log)}
    with Server(log=a.log) as server, tempfile.NamedTemporaryFile(suffix=".jpg") as f:
        url = server.url + "/invocations"
        f.write(photo(1024, 768))
        f.flush()
        body = open(f.name, "rb").read()
        timed_posts(url, body, 2)  # warm-up
        unloaded = median(timed_posts(url, body, 7))

        stall = hc.cmd_stall(
            Namespace(
                url=url,
                connections=a.stalled,
                declared=100_000,
                sent=1024,
                normal=5,
                normal_image=f.name,
                normal_type="image/jpeg",
            )
        )
        normal = [n["seconds"] for n in stall["normal"] if n.get("status") == 200]
        stalled_after = [s["after_s"] for s in stall["stalled"]]
        statuses = {}
        for s in stall["stalled"]:
            key = str(s.get("status") or s.get("exception", "closed"))
            statuses[key] = statuses.get(key, 0) + 1
        out["stall"] = {
            "stalled": a.stalled,
            "unloaded_s": unloaded,
            "normal_ok": len(normal),
            "normal_median_s": median(normal),
            "normal_ratio": median(normal) / unloaded if normal else None,
            "stalled_held_while_normal_ran": stall["stalled_still_open_after_normal"],
            "stalled_answers": statuses,
            "stalled_answered_by_s": max(stalled_after),
        }

        floods = {}
        for clients in (4, 64):
            floods[clients] = hc.cmd_flood(
                Namespace(
                    url=url,
                    image=f.name,
                    content_type="image/jpeg",
                    clients=clients,
                    seconds=a.flood_seconds,
                    backoff=False,
                )
            )
        bad = {k: v for k, v in floods[64]["counts"].items() if k not in ("200", "503")}
        out["flood"] = {
            "4": floods[4],
            "64": floods[64],
            "not_200_or_503_at_64": bad,
            "p99_ratio_64_vs_4": floods[64]["p99_s"] / floods[4]["p99_s"],
        }

        big = hc.early_httpclient(url, b"\xab" * 30_000_000, "image/jpeg", 2)
        out["http_client_30mb"] = big

    json.dump(out, sys.stdout, indent=1)
    print()
    if a.check:
        misses = []
        if out["rss"]["peak_rss_mb_4_clients_1080p"] > 800:
            misses.append("peak RSS over 800 MB")
        s = out["stall"]
        if s["normal_ok"] != 5 or s["normal_ratio"] > 2:
            misses.append("normal requests under stalled uploads")
        if s["stalled_answered_by_s"] > 35:
            misses.append("stalled uploads held past the body limit")
        if out["flood"]["not_200_or_503_at_64"] or out["flood"]["p99_ratio_64_vs_4"] > 3:
            misses.append("flood")
        if any(b.get("status") != 413 for b in big):
            misses.append("30 MB body not read as 413")
        if misses:
            sys.exit("missed: " + ", ".join(misses))


if __name__ == "__main__":
    main()
