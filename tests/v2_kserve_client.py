"""KServe's Python v2 REST client (kserve.InferenceRESTClient, RESTConfig(protocol="v2"))
against `celer serve`'s Open Inference Protocol routes: health (server live and ready,
model ready), and infer with the image as a BYTES tensor (binary-data extension, and
base64 in JSON) and as a UINT8 [H, W, 3] tensor (binary and JSON). Every alpha must be
within 1 LSB of what POST /invocations answers for the same photo. The client has no
metadata call, so the metadata and health answers are read over HTTP and validated with
the data model of KServe's own server (kserve.protocol.rest.v2_datamodels). Run by
tests/v2.rs: `python tests/v2_kserve_client.py HOST:PORT PHOTO MODEL`; exits non-zero on
a failure.
"""

import asyncio
import base64
import io
import sys

import httpx
import numpy as np
from kserve import InferenceRESTClient, InferInput, InferRequest, RESTConfig
from kserve.protocol.infer_type import RequestedOutput
from kserve.protocol.rest import v2_datamodels as v2
from PIL import Image, ImageOps

from v2_common import close_to, invocations_alpha


def asked(name, binary):
    return RequestedOutput(name, parameters={"binary_data": binary})


async def metadata_as_kserve_serves_it(url, model):
    """The answers of the routes the client has no call for, held to the data model of
    KServe's own server: a field missing or of another type fails validation."""
    async with httpx.AsyncClient(base_url=url) as http:
        server = v2.ServerMetadataResponse.model_validate((await http.get("/v2")).json())
        assert server.name == "celer" and "binary_tensor_data" in server.extensions, server
        meta = (await http.get(f"/v2/models/{model}")).json()
        meta = v2.ModelMetadataResponse.model_validate(meta)
        assert meta.name == model and meta.versions == ["1"], meta
        assert [(t.name, t.datatype) for t in meta.inputs] == [
            ("image", "BYTES"),
            ("image_rgb", "UINT8"),
        ], meta
        assert [(t.name, t.datatype) for t in meta.outputs] == [
            ("alpha", "UINT8"),
            ("trimap", "UINT8"),
            ("cutout", "BYTES"),
        ], meta
        live = v2.ServerLiveResponse.model_validate((await http.get("/v2/health/live")).json())
        ready = v2.ServerReadyResponse.model_validate((await http.get("/v2/health/ready")).json())
        model_ready = (await http.get(f"/v2/models/{model}/ready")).json()
        model_ready = v2.ModelReadyResponse.model_validate(model_ready)
        assert live.live and ready.ready, (live, ready)
        assert (model_ready.name, model_ready.ready) == (model, True), model_ready
        missing = await http.get("/v2/models/nobody")
        assert missing.status_code == 404 and "error" in missing.json(), missing.text
    print("metadata: server, model and health answers match kserve's v2 data model")


async def main():
    host_port, photo_path, model = sys.argv[1], sys.argv[2], sys.argv[3]
    url = f"http://{host_port}"
    photo = open(photo_path, "rb").read()
    expected = invocations_alpha(url, photo)
    client = InferenceRESTClient(RESTConfig(protocol="v2", retries=0, timeout=60))
    async with client:
        assert await client.is_server_live(url) is True
        assert await client.is_server_ready(url) is True
        assert await client.is_model_ready(url, model) is True
        assert await client.is_model_ready(url, "nobody") is False
        await metadata_as_kserve_serves_it(url, model)

        # BYTES with the binary-data extension; alpha and trimap back in binary.
        image = InferInput("image", [1], "BYTES")
        image.set_data_from_numpy(np.array([photo], dtype=np.object_), binary_data=True)
        request = InferRequest(
            model,
            [image],
            request_id="k1",
            request_outputs=[asked("alpha", True), asked("trimap", True)],
        )
        result = await client.infer(url, request, model_name=model)
        assert (result.model_name, result.id) == (model, "k1"), result
        assert [o.name for o in result.outputs] == ["alpha", "trimap"], result
        close_to("BYTES binary", result.outputs[0].as_numpy(), expected)
        trimap = result.outputs[1].as_numpy()
        assert set(np.unique(trimap)) <= {0, 128, 255}, np.unique(trimap)

        # BYTES in JSON: the client sends JSON strings, so the image travels in base64;
        # the cut-out comes back as base64 in JSON too (the client reads a binary BYTES
        # output as UTF-8 text, which a PNG is not).
        image = InferInput("image", [1], "BYTES")
        image.set_data_from_numpy(
            np.array([base64.b64encode(photo)], dtype=np.object_), binary_data=False
        )
        request = InferRequest(
            model, [image], request_outputs=[asked("alpha", False), asked("cutout", False)]
        )
        result = await client.infer(url, request, model_name=model)
        alpha, cutout = result.outputs
        close_to("BYTES JSON", alpha.as_numpy(), expected)
        assert (cutout.name, cutout.datatype, cutout.shape) == ("cutout", "BYTES", [1]), cutout
        cutout = Image.open(io.BytesIO(base64.b64decode(cutout.data[0])))
        assert cutout.mode == "RGBA" and cutout.size == expected.shape[::-1], cutout
        close_to("cut-out's alpha", np.asarray(cutout)[:, :, 3], expected)

        # UINT8 [H, W, 3]: the decoded, upright pixels. PIL's JPEG decoder rounds
        # otherwise than celer's, so the reference is /invocations given these very
        # pixels (as PNG). In binary, then as a JSON list of numbers.
        rgb = np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(photo))).convert("RGB"))
        png = io.BytesIO()
        Image.fromarray(rgb).save(png, format="PNG")
        expected = invocations_alpha(url, png.getvalue(), "image/png")
        for binary in (True, False):
            image = InferInput("image_rgb", list(rgb.shape), "UINT8")
            image.set_data_from_numpy(rgb, binary_data=binary)
            request = InferRequest(model, [image], request_outputs=[asked("alpha", binary)])
            result = await client.infer(url, request, model_name=model)
            close_to(
                f"UINT8 {'binary' if binary else 'JSON'}", result.outputs[0].as_numpy(), expected
            )

        # A protocol error: the client raises with celer's status and message, and the
        # server stays up.
        bad = InferInput("image", [1], "BYTES")
        bad.set_data_from_numpy(np.array([b"not an image"], dtype=np.object_), binary_data=True)
        try:
            await client.infer(url, InferRequest(model, [bad]), model_name=model)
            raise AssertionError("a non-image was accepted")
        except httpx.HTTPStatusError as e:
            assert e.response.status_code == 415, e
            print(f"refused as expected: {e}")
        assert await client.is_server_ready(url) is True
    print("kserve client: ok")


if __name__ == "__main__":
    asyncio.run(main())
