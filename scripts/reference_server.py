#!/usr/bin/env python3
"""The baseline celer is measured against: the SageMaker handler users deploy today.

FastAPI on uvicorn, PIL decode and resize, numpy normalise / threshold / guided filter /
composite, one onnxruntime session shared by the request threads, PIL PNG encode at its
default level. The pipeline is scripts/reference.py's (the same stages and parameters as
celer's, read from the same celer.toml), so the comparison is of the implementations.
Speaks the same contract: GET /ping, POST /invocations (image bytes), and sends a
Server-Timing header so `celer bench http` can split model time from the rest.

  .venv/bin/python scripts/reference_server.py --model-dir onnx/u2netp --port 8081
"""
import argparse
import io
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import uvicorn
from fastapi import FastAPI, Request, Response
from PIL import Image, ImageOps
from starlette.concurrency import run_in_threadpool

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reference import load_config, matte, to_u8  # noqa: E402


def build_app(model_dir: Path) -> FastAPI:
    cfg = load_config(model_dir)
    sess = ort.InferenceSession(str(cfg["model"]), providers=["CPUExecutionProvider"])
    app = FastAPI()

    @app.get("/ping")
    def ping() -> dict:
        return {"status": "ok"}

    @app.post("/invocations")
    async def invocations(request: Request) -> Response:
        # What FastAPI does with a sync endpoint: the work runs in its thread pool.
        return await run_in_threadpool(handle, await request.body())

    def handle(body: bytes) -> Response:
        clock: dict = {}
        t = time.perf_counter()
        try:
            with Image.open(io.BytesIO(body)) as im:
                rgb = ImageOps.exif_transpose(im).convert("RGB")
        except Exception as e:  # the handler pattern: any decode failure is a 400
            return Response(content=f'{{"error": "{e}"}}', status_code=400, media_type="application/json")
        clock["decode"] = time.perf_counter() - t
        _, _, alpha = matte(cfg, sess, rgb, clock)
        t = time.perf_counter()
        rgba = np.dstack([np.asarray(rgb), to_u8(alpha)])
        clock["composite"] = time.perf_counter() - t
        t = time.perf_counter()
        out = io.BytesIO()
        Image.fromarray(rgba, mode="RGBA").save(out, format="PNG")
        clock["encode"] = time.perf_counter() - t
        timing = ", ".join(f"{k};dur={v * 1e3:.3f}" for k, v in clock.items())
        return Response(content=out.getvalue(), media_type="image/png", headers={"Server-Timing": timing})

    return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", type=Path, default=Path("onnx/u2netp"))
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8081)
    args = ap.parse_args()
    uvicorn.run(build_app(args.model_dir), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
