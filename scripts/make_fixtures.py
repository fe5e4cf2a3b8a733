#!/usr/bin/env python3
"""Generate the tiny ONNX fixture models in onnx/fixtures/ (committed; a few hundred bytes each).

Owns onnx/fixtures/{seg3,prob,matting,prob-nonzero}.onnx. All: opset 17, IR version 9,
float32 images, dynamic batch dim "batch", fixed 64x64. With m = mean of the 3 image channels:
  seg3.onnx     image[b,3,64,64] -> scores[b,3,64,64], scores_c = w_c*m + b_c,
                w = [-3, 0, 3], b = [1, 0, -2]: argmax is 0 for m<1/3, 1 between, 2 for m>2/3
  prob.onnx     image[b,3,64,64] -> mask[b,1,64,64] = Sigmoid(8*(m - 0.5))
  matting.onnx  image[b,3,64,64], trimap[b,1,64,64] -> alpha[b,1,64,64]
                = Clip(0.75*trimap + 0.25*m, 0, 1)
  prob-nonzero.onnx  prob.onnx's mask, and a second output whose size depends on the
                pixels' values, not on the input's shape: foreground[4, n] (int64) =
                NonZero(mask > 0.5), the indices of the n foreground pixels (what TensorRT
                calls a data-dependent shape: -1 until the engine runs)
Each is a 1x1 Conv (plus Sigmoid/Clip/NonZero), checked with onnx.checker and with
onnxruntime against numpy on random input. Run with .venv/bin/python; the output is
deterministic.
"""
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

OUT = Path(__file__).resolve().parent.parent / "onnx" / "fixtures"
HW = 64


def value(name: str, channels: int) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch", channels, HW, HW])


def conv(x: str, y: str, weight, bias) -> tuple[onnx.NodeProto, list]:
    """1x1 Conv x -> y; weight [out][in], bias [out]."""
    w = np.asarray(weight, np.float32)[:, :, None, None]
    inits = [numpy_helper.from_array(w, f"{y}_w"), numpy_helper.from_array(np.asarray(bias, np.float32), f"{y}_b")]
    return helper.make_node("Conv", [x, f"{y}_w", f"{y}_b"], [y], kernel_shape=[1, 1]), inits


def model(name: str, nodes, inits, inputs, outputs) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, name, inputs, outputs, initializer=inits)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                          producer_name="celer scripts/make_fixtures.py", ir_version=9)
    onnx.checker.check_model(m, full_check=True)
    return m


def seg3() -> onnx.ModelProto:
    w, b = [-3.0, 0.0, 3.0], [1.0, 0.0, -2.0]
    node, inits = conv("image", "scores", [[wc / 3] * 3 for wc in w], b)
    return model("seg3", [node], inits, [value("image", 3)], [value("scores", 3)])


def prob() -> onnx.ModelProto:
    node, inits = conv("image", "logit", [[8.0 / 3] * 3], [-4.0])
    sig = helper.make_node("Sigmoid", ["logit"], ["mask"])
    return model("prob", [node, sig], inits, [value("image", 3)], [value("mask", 1)])


def matting() -> onnx.ModelProto:
    cat = helper.make_node("Concat", ["image", "trimap"], ["x"], axis=1)
    node, inits = conv("x", "mix", [[0.25 / 3] * 3 + [0.75]], [0.0])
    inits += [numpy_helper.from_array(np.float32(0), "zero"), numpy_helper.from_array(np.float32(1), "one")]
    clip = helper.make_node("Clip", ["mix", "zero", "one"], ["alpha"])
    return model("matting", [cat, node, clip], inits,
                 [value("image", 3), value("trimap", 1)], [value("alpha", 1)])


def prob_nonzero() -> onnx.ModelProto:
    node, inits = conv("image", "logit", [[8.0 / 3] * 3], [-4.0])
    sig = helper.make_node("Sigmoid", ["logit"], ["mask"])
    inits.append(numpy_helper.from_array(np.float32(0.5), "half"))
    above = helper.make_node("Greater", ["mask", "half"], ["above"])
    nonzero = helper.make_node("NonZero", ["above"], ["foreground"])
    foreground = helper.make_tensor_value_info("foreground", TensorProto.INT64, [4, "foreground_pixels"])
    return model("prob-nonzero", [node, sig, above, nonzero], inits, [value("image", 3)],
                 [value("mask", 1), foreground])


def check(path: Path, feeds: dict, output: str, want: np.ndarray) -> None:
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (got,) = sess.run([output], feeds)
    assert got.shape == want.shape, (path.name, got.shape, want.shape)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=path.name)


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for name, build in [("seg3", seg3), ("prob", prob), ("matting", matting), ("prob-nonzero", prob_nonzero)]:
        onnx.save(build(), OUT / f"{name}.onnx")

    rng = np.random.default_rng(17)
    image = rng.random((2, 3, HW, HW), dtype=np.float32)
    trimap = rng.choice(np.float32([0, 0.5, 1]), (2, 1, HW, HW))
    m = image.mean(axis=1, keepdims=True)
    w, b = np.float32([-3, 0, 3])[None, :, None, None], np.float32([1, 0, -2])[None, :, None, None]
    check(OUT / "seg3.onnx", {"image": image}, "scores", w * m + b)
    check(OUT / "prob.onnx", {"image": image}, "mask", 1 / (1 + np.exp(-8 * (m - 0.5))))
    check(OUT / "matting.onnx", {"image": image, "trimap": trimap}, "alpha",
          np.clip(0.75 * trimap + 0.25 * m, 0, 1))
    mask = 1 / (1 + np.exp(-8 * (m - 0.5)))
    check(OUT / "prob-nonzero.onnx", {"image": image}, "mask", mask)
    check(OUT / "prob-nonzero.onnx", {"image": image}, "foreground",
          np.stack(np.nonzero(mask > 0.5)).astype(np.int64))
    # seg3's classes on flat grey images: m = 0.1 -> 0, 0.5 -> 1, 0.9 -> 2.
    sess = ort.InferenceSession(str(OUT / "seg3.onnx"), providers=["CPUExecutionProvider"])
    grey = np.float32([0.1, 0.5, 0.9])[:, None, None, None] * np.ones((1, 3, HW, HW), np.float32)
    classes = sess.run(["scores"], {"image": grey})[0].argmax(axis=1)
    assert (classes == np.arange(3)[:, None, None]).all(), "seg3 argmax"
    for p in sorted(OUT.glob("*.onnx")):
        print(f"make_fixtures: {p.relative_to(OUT.parent.parent)} ({p.stat().st_size} bytes) verified")


if __name__ == "__main__":
    main()
