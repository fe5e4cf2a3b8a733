"""The Open Inference Protocol over gRPC, with the clients users call it with: Triton's
(tritonclient.grpc) and KServe's (kserve.InferenceGRPCClient), plus gRPC's standard health
service called as Kubernetes' gRPC probe calls it. Health, metadata, Triton's model
config, and infer with the image as BYTES (raw contents) and as UINT8 [H, W, 3] (raw from
tritonclient, typed uint_contents from kserve), answered in the request's layout; every
alpha must equal what POST /invocations answers for the same photo (the UINT8 image is the PNG
photo's pixels, which celer decodes identically), and refused inputs must get the right
gRPC status. Run by tests/grpc.rs, once per client (their generated modules both define
the protocol's `inference` package, which protobuf's one descriptor pool per process
cannot hold twice):

    python tests/grpc_clients.py triton|kserve GRPC_HOST:PORT HTTP_HOST:PORT JPEG PNG MODEL

Exits non-zero on a failure; prints `tritonclient.grpc: ok` or `kserve grpc client: ok`
at the end.
"""

import asyncio
import io
import sys

import grpc
import numpy as np
from PIL import Image

from v2_common import invocations_alpha


def same(what, alpha, expected):
    assert alpha.dtype == np.uint8, f"{what}: {alpha.dtype}"
    assert alpha.shape == expected.shape, f"{what}: shape {alpha.shape} vs {expected.shape}"
    differ = int(np.count_nonzero(alpha != expected))
    assert differ == 0, f"{what}: {differ} pixels differ from /invocations' alpha"
    print(f"{what}: alpha {alpha.shape} equals /invocations'")


def refused(what, call, code):
    from tritonclient.utils import InferenceServerException

    try:
        call()
    except InferenceServerException as e:
        assert e.status() == f"StatusCode.{code}", f"{what}: {e.status()} {e.message()}"
        print(f"{what}: {code} ({e.message()})")
        return
    raise AssertionError(f"{what}: accepted")


def triton(grpc_url, jpeg, png_pixels, expected_jpeg, expected_png, model):
    import tritonclient.grpc as tc

    c = tc.InferenceServerClient(grpc_url)
    assert c.is_server_live() and c.is_server_ready() and c.is_model_ready(model)
    assert c.get_server_metadata().name == "celer"
    meta = c.get_model_metadata(model)
    assert meta.versions == ["1"], meta
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.inputs] == [
        ("image", "BYTES", [1]),
        ("image_rgb", "UINT8", [-1, -1, 3]),
    ], meta
    assert [(t.name, t.datatype) for t in meta.outputs] == [
        ("alpha", "UINT8"),
        ("trimap", "UINT8"),
        ("cutout", "BYTES"),
    ], meta
    config = c.get_model_config(model).config
    assert config.name == model and config.max_batch_size == 0, config
    assert [(i.name, tc.model_config_pb2.DataType.Name(i.data_type)) for i in config.input] == [
        ("image", "TYPE_STRING"),
        ("image_rgb", "TYPE_UINT8"),
    ], config
    print("tritonclient.grpc: health, metadata and config")

    # BYTES in raw contents (tritonclient sends every input raw); all three outputs back
    # in raw contents.
    image = tc.InferInput("image", [1], "BYTES")
    image.set_data_from_numpy(np.array([jpeg], dtype=np.object_))
    asked = [tc.InferRequestedOutput(n) for n in ("alpha", "trimap", "cutout")]
    r = c.infer(model, [image], outputs=asked, request_id="g1")
    assert r.get_response().id == "g1"
    assert len(r.get_response().raw_output_contents) == 3, "outputs in raw contents"
    alpha = r.as_numpy("alpha")
    same("tritonclient.grpc BYTES", alpha, expected_jpeg)
    trimap = r.as_numpy("trimap")
    assert set(np.unique(trimap)) <= {0, 128, 255}, np.unique(trimap)
    cutout = np.asarray(Image.open(io.BytesIO(r.as_numpy("cutout")[0])))
    assert cutout.shape == (*alpha.shape, 4), cutout.shape
    assert (cutout[..., 3] == alpha).all(), "the cut-out's alpha is the alpha"

    # UINT8 [H, W, 3] in raw contents.
    rgb = tc.InferInput("image_rgb", list(png_pixels.shape), "UINT8")
    rgb.set_data_from_numpy(png_pixels)
    r = c.infer(model, [rgb], outputs=[tc.InferRequestedOutput("alpha")])
    same("tritonclient.grpc UINT8", r.as_numpy("alpha"), expected_png)

    # Refusals, each with its status.
    wrong = tc.InferInput("image", [1], "FP32")
    wrong.set_data_from_numpy(np.zeros([1], dtype=np.float32))
    refused("wrong datatype", lambda: c.infer(model, [wrong]), "INVALID_ARGUMENT")
    refused("unknown model", lambda: c.infer("nobody", [image]), "NOT_FOUND")
    refused("unknown model's config", lambda: c.get_model_config("nobody"), "NOT_FOUND")
    junk = tc.InferInput("image", [1], "BYTES")
    junk.set_data_from_numpy(np.array([b"not an image"], dtype=np.object_))
    refused("not an image", lambda: c.infer(model, [junk]), "INVALID_ARGUMENT")
    refused(
        "unknown output",
        lambda: c.infer(model, [image], outputs=[tc.InferRequestedOutput("mask")]),
        "INVALID_ARGUMENT",
    )
    c.close()
    print("tritonclient.grpc: ok")


async def kserve(grpc_url, jpeg, png_pixels, expected_jpeg, expected_png, model):
    from kserve import InferenceGRPCClient, InferInput, InferRequest
    from kserve.protocol.infer_type import RequestedOutput

    c = InferenceGRPCClient(grpc_url, retries=0, timeout=60)
    assert await c.is_server_live() is True
    assert await c.is_server_ready() is True
    assert await c.is_model_ready(model) is True

    # BYTES in raw contents (kserve sends bytes that are not UTF-8 only raw) and UINT8
    # typed (uint_contents): both layouts of the protocol, each answered in the request's.
    image = InferInput("image", [1], "BYTES")
    image.set_data_from_numpy(np.array([jpeg], dtype=np.object_))
    request = InferRequest(model, [image], request_id="k1", request_outputs=[RequestedOutput("alpha")])
    assert request.to_grpc().raw_input_contents, "BYTES raw"
    r = await c.infer(request)
    assert r.id == "k1" and [o.name for o in r.outputs] == ["alpha"], r
    same("kserve grpc BYTES", r.outputs[0].as_numpy().astype(np.uint8), expected_jpeg)

    rgb = InferInput("image_rgb", list(png_pixels.shape), "UINT8")
    rgb.set_data_from_numpy(png_pixels, binary_data=False)
    assert not InferRequest(model, [rgb]).to_grpc().raw_input_contents, "UINT8 typed"
    r = await c.infer(InferRequest(model, [rgb], request_outputs=[RequestedOutput("alpha")]))
    same("kserve grpc UINT8", r.outputs[0].as_numpy().astype(np.uint8), expected_png)

    try:
        await c.infer(InferRequest("nobody", [image]))
        raise AssertionError("kserve: an unknown model was accepted")
    except grpc.aio.AioRpcError as e:
        assert e.code() == grpc.StatusCode.NOT_FOUND, e
        print(f"kserve unknown model: NOT_FOUND ({e.details()})")
    await c.close()
    print("kserve grpc client: ok")


def health(grpc_url):
    """grpc.health.v1.Health/Check as a Kubernetes gRPC probe calls it. The messages are
    one string field and one enum field: encoded here by hand."""
    with grpc.insecure_channel(grpc_url) as channel:
        check = channel.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=lambda service: (
                b"" if not service else b"\x0a" + bytes([len(service)]) + service.encode()
            ),
            response_deserializer=lambda data: data,
        )
        for service in ["", "inference.GRPCInferenceService"]:
            answer = check(service, timeout=10)
            assert answer == b"\x08\x01", f"{service!r}: {answer!r} is not SERVING"
        try:
            check("no.such.Service", timeout=10)
            raise AssertionError("an unknown service has a health")
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.NOT_FOUND, e
    print("grpc health: SERVING, unknown service NOT_FOUND")


def main():
    client, grpc_url, http_url, jpeg_path, png_path, model = sys.argv[1:7]
    jpeg = open(jpeg_path, "rb").read()
    png = open(png_path, "rb").read()
    expected_jpeg = invocations_alpha(f"http://{http_url}", jpeg)
    expected_png = invocations_alpha(f"http://{http_url}", png, "image/png")
    png_pixels = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))
    args = (grpc_url, jpeg, png_pixels, expected_jpeg, expected_png, model)
    if client == "triton":
        health(grpc_url)
        triton(*args)
    elif client == "kserve":
        asyncio.run(kserve(*args))
    else:
        raise SystemExit(f"no client {client!r}: triton or kserve")


if __name__ == "__main__":
    main()
