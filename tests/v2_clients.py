"""Triton's Python HTTP client (tritonclient.http) against `celer serve`'s Open Inference
Protocol routes: health, metadata, config, and infer with the image as a BYTES tensor
(JSON base64 and the binary-data extension) and as a UINT8 [H, W, 3] tensor. Every alpha
must be within 1 LSB of what POST /invocations answers for the same photo. Run by
tests/v2.rs: `python tests/v2_clients.py HOST:PORT PHOTO`; exits non-zero on a failure.
"""

import base64
import io
import sys

import numpy as np
import tritonclient.http as httpclient
from PIL import Image, ImageOps
from tritonclient.utils import InferenceServerException

from v2_common import close_to, invocations_alpha


def main():
    url, photo_path = sys.argv[1], sys.argv[2]
    photo = open(photo_path, "rb").read()
    expected = invocations_alpha(f"http://{url}", photo)
    client = httpclient.InferenceServerClient(url=url)

    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready("celer")
    assert not client.is_model_ready("nobody")
    meta = client.get_model_metadata("celer")
    assert [i["name"] for i in meta["inputs"]] == ["image", "image_rgb"], meta
    assert [o["name"] for o in meta["outputs"]] == ["alpha", "trimap", "cutout"], meta
    config = client.get_model_config("celer")
    assert config["max_batch_size"] == 0, config
    assert client.get_server_metadata()["name"] == "celer"

    outputs = lambda binary: [  # noqa: E731
        httpclient.InferRequestedOutput("alpha", binary_data=binary),
        httpclient.InferRequestedOutput("trimap", binary_data=binary),
        httpclient.InferRequestedOutput("cutout", binary_data=binary),
    ]

    # BYTES, binary-data extension both ways.
    image = httpclient.InferInput("image", [1], "BYTES")
    image.set_data_from_numpy(np.array([photo], dtype=np.object_), binary_data=True)
    result = client.infer("celer", [image], outputs=outputs(True), request_id="b1")
    assert result.get_response()["id"] == "b1"
    close_to("BYTES binary", result.as_numpy("alpha"), expected)
    trimap = result.as_numpy("trimap")
    assert set(np.unique(trimap)) <= {0, 128, 255}, np.unique(trimap)
    cutout = Image.open(io.BytesIO(result.as_numpy("cutout")[0]))
    assert cutout.mode == "RGBA" and cutout.size == expected.shape[::-1], cutout
    close_to("cut-out's alpha", np.asarray(cutout)[:, :, 3], expected)

    # BYTES in JSON: an image is not UTF-8, so it travels in base64; answers in JSON.
    image = httpclient.InferInput("image", [1], "BYTES")
    image.set_data_from_numpy(
        np.array([base64.b64encode(photo)], dtype=np.object_), binary_data=False
    )
    result = client.infer(
        "celer", [image], outputs=[httpclient.InferRequestedOutput("alpha", binary_data=False)]
    )
    close_to("BYTES JSON", result.as_numpy("alpha"), expected)

    # UINT8 [H, W, 3]: the decoded, upright pixels. PIL's JPEG decoder rounds otherwise
    # than celer's, so the reference is /invocations given these very pixels (as PNG).
    rgb = np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(photo))).convert("RGB"))
    png = io.BytesIO()
    Image.fromarray(rgb).save(png, format="PNG")
    expected = invocations_alpha(f"http://{url}", png.getvalue(), "image/png")
    image = httpclient.InferInput("image_rgb", list(rgb.shape), "UINT8")
    image.set_data_from_numpy(rgb, binary_data=True)
    result = client.infer(
        "celer", [image], outputs=[httpclient.InferRequestedOutput("alpha", binary_data=True)]
    )
    close_to("UINT8 binary", result.as_numpy("alpha"), expected)

    # A protocol error: the message comes back, and the server stays up.
    bad = httpclient.InferInput("image", [1], "BYTES")
    bad.set_data_from_numpy(np.array([b"not an image"], dtype=np.object_), binary_data=True)
    try:
        client.infer("celer", [bad])
        raise AssertionError("a non-image was accepted")
    except InferenceServerException as e:
        assert e.status() == "415" or "format" in str(e), e
        print(f"refused as expected: {e}")
    assert client.is_server_ready()
    print("tritonclient: ok")


if __name__ == "__main__":
    main()
