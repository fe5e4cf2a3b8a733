"""Scrapes celer's /metrics as Prometheus would and prints what it parsed, as JSON: the
parser is prometheus_client's (the Prometheus project's Python client, in .venv from
scripts/requirements-kserve.txt), so a family whose text it reads differently (a type,
a name, a label) shows here as it would in a dashboard.

    python tests/metrics_scrape.py HOST:PORT
"""

import json
import sys
import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def main() -> None:
    with urllib.request.urlopen(f"http://{sys.argv[1]}/metrics", timeout=30) as r:
        content_type = r.headers["Content-Type"]
        text = r.read().decode()
    families = {
        f.name: {
            "type": f.type,
            "samples": [
                {"name": s.name, "labels": s.labels, "value": s.value} for s in f.samples
            ],
        }
        for f in text_string_to_metric_families(text)
    }
    print(json.dumps({"content_type": content_type, "families": families}))


if __name__ == "__main__":
    main()
