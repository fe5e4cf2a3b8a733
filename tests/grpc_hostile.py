"""Hostile calls over gRPC against `celer serve`, each of which must get its gRPC status
while the server keeps answering: a message over the size limit, a wrong datatype, shapes
whose element count overflows or passes the pixel limit, an unknown model and version, a
deadline too short to meet, and a flood of concurrent calls past the admission limit
(RESOURCE_EXHAUSTED with a retry hint, never an error of another kind). The requests are
built from the protocol's messages as Triton's client generates them (its service_pb2),
so that inputs the client library would refuse can be sent. Run by tests/grpc.rs:

    python tests/grpc_hostile.py GRPC_HOST:PORT PHOTO MAX_MESSAGE_BYTES

Prints `grpc hostile: ok` at the end; exits non-zero on a failure.
"""

import struct
import sys

import grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc


def bytes_input(data, name="image", datatype="BYTES", shape=(1,)):
    request = service_pb2.ModelInferRequest(model_name="celer")
    tensor = request.inputs.add()
    tensor.name, tensor.datatype = name, datatype
    tensor.shape.extend(shape)
    request.raw_input_contents.append(data)
    return request


def element(image):
    return struct.pack("<I", len(image)) + image


def expect(what, call, code):
    try:
        call()
    except grpc.RpcError as e:
        assert e.code() == code, f"{what}: {e.code()} {e.details()}"
        print(f"{what}: {code.name} ({e.details()})")
        return e
    raise AssertionError(f"{what}: accepted")


def main():
    url, photo_path, max_message = sys.argv[1], sys.argv[2], int(sys.argv[3])
    photo = open(photo_path, "rb").read()
    channel = grpc.insecure_channel(
        url, options=[("grpc.max_receive_message_length", 64 << 20)]
    )
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    infer = lambda request, **kw: stub.ModelInfer(request, timeout=kw.get("timeout", 60))  # noqa: E731

    ok = infer(bytes_input(element(photo)))
    assert ok.outputs[0].name == "alpha", ok.outputs
    print("a photo: answered")

    oversized = bytes_input(element(b"\xff" * (max_message + 1024)))
    expect("a message over the size limit", lambda: infer(oversized), grpc.StatusCode.OUT_OF_RANGE)

    expect(
        "a wrong datatype",
        lambda: infer(bytes_input(element(photo), datatype="FP32")),
        grpc.StatusCode.INVALID_ARGUMENT,
    )
    expect(
        "a shape whose element count overflows",
        lambda: infer(bytes_input(element(photo), shape=(1 << 62, 1 << 62))),
        grpc.StatusCode.INVALID_ARGUMENT,
    )
    expect(
        "a UINT8 shape past the pixel limit",
        lambda: infer(bytes_input(b"\0" * 12, "image_rgb", "UINT8", (1 << 31, 1 << 31, 3))),
        grpc.StatusCode.INVALID_ARGUMENT,
    )
    expect(
        "a negative dimension",
        lambda: infer(bytes_input(b"\0" * 12, "image_rgb", "UINT8", (-2, 2, 3))),
        grpc.StatusCode.INVALID_ARGUMENT,
    )
    unknown = bytes_input(element(photo))
    unknown.model_name = "nobody"
    expect("an unknown model", lambda: infer(unknown), grpc.StatusCode.NOT_FOUND)
    version = bytes_input(element(photo))
    version.model_version = "7"
    expect("an unknown version", lambda: infer(version), grpc.StatusCode.NOT_FOUND)
    expect(
        "a deadline too short to meet",
        lambda: infer(bytes_input(element(photo)), timeout=0.002),
        grpc.StatusCode.DEADLINE_EXCEEDED,
    )

    # A flood: many more concurrent calls than the server admits. Each is answered, with
    # a result or a refusal at once and its retry hint: RESOURCE_EXHAUSTED, or, where the
    # queue ahead could not be run within the server's deadline (3 s here) at the pace of
    # the slowest recent runs, DEADLINE_EXCEEDED coded deadline_unreachable.
    flood = 24
    calls = [stub.ModelInfer.future(bytes_input(element(photo)), timeout=120) for _ in range(flood)]
    answered, refused = 0, 0
    for call in calls:
        try:
            call.result()
            answered += 1
        except grpc.RpcError as e:
            trailers = dict(e.trailing_metadata() or ())
            code = trailers.get("celer-error-code")
            assert (e.code(), code) in [
                (grpc.StatusCode.RESOURCE_EXHAUSTED, "overloaded"),
                (grpc.StatusCode.DEADLINE_EXCEEDED, "deadline_unreachable"),
            ], f"flood: {e.code()} {code} {e.details()}"
            assert int(trailers.get("grpc-retry-pushback-ms", "0")) > 0, trailers
            refused += 1
    assert answered >= 1 and refused >= 1, (answered, refused)
    print(f"a flood of {flood}: {answered} answered, {refused} refused at once with a retry hint")

    # Still serving (one call at a time: with one replica and one queue place, a second
    # concurrent call can find the place not yet emptied by the replica and be refused).
    for _ in range(2):
        assert infer(bytes_input(element(photo))).outputs
    print("after all of it: answered")
    channel.close()
    print("grpc hostile: ok")


if __name__ == "__main__":
    main()
