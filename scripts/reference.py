#!/usr/bin/env python3
"""Reference implementation (numpy + Pillow + onnxruntime) of celer's CPU pipeline.

Owns tests/data/fetched/reference/ (via `make reference`): the Rust tests compare the Rust
pipeline against these files. For each IMAGE it writes, at the source size (after EXIF):
  <stem>.coarse.png  L: the coarse mask, resized to source size
  <stem>.trimap.png  L: the trimap (0/128/255), resized to source size
  <stem>.alpha.png   L: the final alpha

  .venv/bin/python scripts/reference.py --model-dir onnx/u2netp --out DIR IMAGE...

Parameters come from <model-dir>/celer.toml (same file and defaults as the Rust side).
Arithmetic is float32 like the Rust side, except the guided filter's box sums (float64).
Only kind = "guided-filter" matting is implemented.
"""
import argparse
import sys
import time
import tomllib
from pathlib import Path

import numpy as np
import onnxruntime as ort
from PIL import Image, ImageOps

F32 = np.float32


def load_config(model_dir: Path) -> dict:
    path = model_dir / "celer.toml"
    with open(path, "rb") as f:
        cfg = tomllib.load(f)
    seg = cfg["segmentation"]
    norm = seg["normalize"]
    mask = seg["mask"]
    trimap = {"foreground": 0.94, "background": 0.04, "erode_px": 2, **cfg.get("trimap", {})}
    matting = {"kind": "guided-filter", "radius_px": 8, "epsilon": 1e-3, "subsample": 1, **cfg.get("matting", {})}
    if matting["kind"] != "guided-filter":
        sys.exit(f"reference.py: {path}: matting.kind = {matting['kind']!r} is not implemented here")
    return dict(
        model=path.parent / seg["model"], input=seg["input"], output=seg["output"],
        size=(seg["width"], seg["height"]),
        scale=norm["scale"], mean=F32(norm.get("mean", [0, 0, 0])), std=F32(norm.get("std", [1, 1, 1])),
        mask_kind=mask["kind"], minmax=mask.get("minmax", False),
        class_values=np.uint8(mask.get("class_values", [0, 128, 255])),
        fg=F32(trimap["foreground"]), bg=F32(trimap["background"]), erode_px=int(trimap["erode_px"]),
        radius_px=int(matting["radius_px"]), epsilon=float(matting["epsilon"]),
        subsample=int(matting["subsample"]),
    )


def box_sum(x: np.ndarray, r: int) -> tuple[np.ndarray, np.ndarray]:
    """Sum of x over the (2r+1)^2 window clipped to the image, and the in-bounds pixel count."""
    h, w = x.shape
    c = np.zeros((h + 1, w + 1), np.float64)
    c[1:, 1:] = np.cumsum(np.cumsum(x, axis=0, dtype=np.float64), axis=1)
    y0, y1 = np.clip(np.arange(h) - r, 0, h), np.clip(np.arange(h) + r + 1, 0, h)
    x0, x1 = np.clip(np.arange(w) - r, 0, w), np.clip(np.arange(w) + r + 1, 0, w)
    s = c[y1][:, x1] - c[y0][:, x1] - c[y1][:, x0] + c[y0][:, x0]
    return s, (y1 - y0)[:, None] * (x1 - x0)[None, :]


def box_mean(x: np.ndarray, r: int) -> np.ndarray:
    s, n = box_sum(x, r)
    return s / n


def erode(t: np.ndarray, r: int) -> np.ndarray:
    """255 (or 0) survives only where its whole clipped window is 255 (or 0); else 128."""
    out = np.full_like(t, 128)
    for v in (0, 255):
        s, n = box_sum((t == v).astype(np.float64), r)
        out[s == n] = v
    return out


def resize_f(x: np.ndarray, w: int, h: int) -> np.ndarray:
    """PIL mode-F bilinear resize (antialiased when shrinking)."""
    return np.asarray(Image.fromarray(x.astype(F32), mode="F").resize((w, h), Image.BILINEAR))


def luma(rgb: np.ndarray) -> np.ndarray:
    px = rgb.astype(F32)
    return (F32(0.299) * px[..., 0] + F32(0.587) * px[..., 1] + F32(0.114) * px[..., 2]) / F32(255)


def fast_guided_filter(rgb: Image.Image, coarse: np.ndarray, r: int, eps: float, s: int) -> np.ndarray:
    """He & Sun's fast guided filter: the linear coefficients a, b are fitted at 1/s of the
    source size (radius r/s) against the luma of the image resized there (PIL BILINEAR,
    u8), upsampled, and applied to the full-size luma. s = 1 is the classic filter."""
    W, H = rgb.size
    w, h = -(-W // s), -(-H // s)
    rs = max(1, (r + s // 2) // s)  # r/s rounded half up, as the Rust side
    g = luma(np.asarray(rgb.resize((w, h), Image.BILINEAR) if s > 1 else rgb)).astype(np.float64)
    p = np.clip(resize_f(coarse, w, h), 0, 1).astype(np.float64)
    mean_i, mean_p = box_mean(g, rs), box_mean(p, rs)
    cov_ip = box_mean(g * p, rs) - mean_i * mean_p
    var_i = box_mean(g * g, rs) - mean_i * mean_i
    a = cov_ip / (var_i + eps)
    b = mean_p - a * mean_i
    mean_a, mean_b = box_mean(a, rs), box_mean(b, rs)
    if s > 1:
        mean_a, mean_b = resize_f(mean_a, W, H), resize_f(mean_b, W, H)
    return mean_a * luma(np.asarray(rgb)).astype(np.float64) + mean_b


def matte(cfg: dict, sess: ort.InferenceSession, rgb: Image.Image, clock: dict | None = None):
    """The pipeline on a decoded RGB image: returns (coarse at source size, trimap, alpha),
    float arrays in [0, 1] but the u8 trimap. `clock`, if given, gets each stage's seconds."""
    tick = [time.perf_counter()]

    def lap(stage: str) -> None:
        now = time.perf_counter()
        if clock is not None:
            clock[stage] = clock.get(stage, 0.0) + now - tick[0]
        tick[0] = now

    W, H = rgb.size
    # b. resize to the model input, normalise to NCHW float32
    v = np.asarray(rgb.resize(cfg["size"], Image.BILINEAR), dtype=F32)  # h, w, 3
    if cfg["scale"] == "max":
        vmax = v.max()
        s = F32(1) / vmax if vmax > 0 else F32(1)
    else:
        s = F32(cfg["scale"])
    x = ((v * s - cfg["mean"]) / cfg["std"]).transpose(2, 0, 1)[None].astype(F32)
    lap("preprocess")
    # c. model
    (out,) = sess.run([cfg["output"]], {cfg["input"]: np.ascontiguousarray(x)})
    lap("model")
    # d, e. coarse mask and trimap at the output resolution
    if cfg["mask_kind"] == "probability":
        p = out[0, 0].astype(F32)
        if cfg["minmax"]:
            lo, hi = p.min(), p.max()
            if hi > lo:
                p = (p - lo) / (hi - lo)
        p = np.clip(p, 0, 1)
        t0 = np.where(p >= cfg["fg"], 255, np.where(p <= cfg["bg"], 0, 128)).astype(np.uint8)
    elif cfg["mask_kind"] == "classes":
        t0 = cfg["class_values"][np.argmax(out[0], axis=0)]
        p = t0.astype(F32) / F32(255)
    else:
        sys.exit(f"reference.py: unknown segmentation.mask.kind {cfg['mask_kind']!r}")
    t0 = erode(t0, cfg["erode_px"])
    # f. to source size
    trimap = np.asarray(Image.fromarray(t0, mode="L").resize((W, H), Image.NEAREST))
    lap("trimap")
    # g. guided filter on the gray guide; certain regions of the trimap win
    q = fast_guided_filter(rgb, p, cfg["radius_px"], cfg["epsilon"], cfg["subsample"])
    alpha = np.where(trimap == 255, 1.0, np.where(trimap == 0, 0.0, np.clip(q, 0, 1)))
    lap("matting")
    return p, trimap, alpha


def to_u8(a: np.ndarray) -> np.ndarray:
    return np.rint(a * 255).astype(np.uint8)


def run_image(cfg: dict, sess: ort.InferenceSession, path: Path, out_dir: Path) -> None:
    # a. decode, EXIF orientation, RGB8
    with Image.open(path) as im:
        rgb = ImageOps.exif_transpose(im).convert("RGB")
    W, H = rgb.size
    p, trimap, alpha = matte(cfg, sess, rgb)
    # h. u8 outputs (the coarse mask only for inspection)
    p_src = np.clip(np.asarray(Image.fromarray(p.astype(F32), mode="F").resize((W, H), Image.BILINEAR)), 0, 1)
    stem = path.stem
    Image.fromarray(to_u8(p_src), mode="L").save(out_dir / f"{stem}.coarse.png")
    Image.fromarray(trimap, mode="L").save(out_dir / f"{stem}.trimap.png")
    Image.fromarray(to_u8(alpha), mode="L").save(out_dir / f"{stem}.alpha.png")
    print(f"reference: {path} ({W}x{H}) -> {out_dir}/{stem}.{{alpha,trimap,coarse}}.png")


def main() -> None:
    ap = argparse.ArgumentParser(description="celer's CPU pipeline in numpy, for tests")
    ap.add_argument("--model-dir", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("images", type=Path, nargs="+")
    args = ap.parse_args()
    cfg = load_config(args.model_dir)
    sess = ort.InferenceSession(str(cfg["model"]), providers=["CPUExecutionProvider"])
    outputs = [o.name for o in sess.get_outputs()]
    if cfg["output"] not in outputs:
        sys.exit(f"reference.py: {args.model_dir}/celer.toml: segmentation.output = {cfg['output']!r} "
                 f"is not an output of {cfg['model']} (outputs: {', '.join(outputs)})")
    args.out.mkdir(parents=True, exist_ok=True)
    for image in args.images:
        run_image(cfg, sess, image, args.out)


if __name__ == "__main__":
    main()
