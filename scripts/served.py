"""A release `celer serve` started for a measurement (scripts/hostile_figures.py,
scripts/soak.py) and what they need around it: its RSS from /proc, test photos resized
with Pillow, and latency percentiles. Not a test helper: the Rust tests start their own
servers.
"""

import io
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def ort_path():
    return subprocess.check_output([str(ROOT / "scripts/ort-path")], text=True).strip()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`target/release/celer serve` on a free local port, stopped on exit."""

    def __init__(self, model_dir="onnx/u2netp", extra=(), log=None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, ORT_DYLIB_PATH=ort_path(), CELER_LOG="warn")
        cmd = [
            str(ROOT / "target/release/celer"),
            "serve",
            "--model-dir",
            str(ROOT / model_dir),
            "--bind",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--grpc-port",
            "0",
            *extra,
        ]
        self.log = open(log or os.devnull, "w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=self.log)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"celer serve exited with {self.proc.returncode}: {cmd}")
            try:
                with urllib.request.urlopen(self.url + "/ping", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise SystemExit("celer serve did not answer /ping within 120 s")

    def rss_mb(self):
        return _status_kb(self.proc.pid, "VmRSS") / 1024

    def peak_rss_mb(self):
        return _status_kb(self.proc.pid, "VmHWM") / 1024

    def reset_peak(self):
        """Resets VmHWM to the current RSS (Linux >= 4.0)."""
        with open(f"/proc/{self.proc.pid}/clear_refs", "w") as f:
            f.write("5")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def _status_kb(pid, field):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} for {pid}")


def photo(width, height, quality=90):
    """The 1920x1080 test photo resized to `width`x`height`, as JPEG bytes."""
    from PIL import Image

    source = ROOT / "tests/data/fetched/photo-1920x1080.jpg"
    if not source.is_file():
        sys.exit(f"{source} is missing: run `make models`")
    image = Image.open(source).convert("RGB")
    if image.size != (width, height):
        image = image.resize((width, height), Image.LANCZOS)
    out = io.BytesIO()
    image.save(out, "JPEG", quality=quality)
    return out.getvalue()


def percentile(sorted_values, p):
    if not sorted_values:
        return None
    return sorted_values[min(len(sorted_values) - 1, int(p / 100 * len(sorted_values)))]


def median(values):
    return percentile(sorted(values), 50)
