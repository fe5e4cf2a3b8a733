//! ISNet's TensorRT engines against ONNX Runtime, as tests/tensorrt_engine.rs holds U2NetP
//! (same tolerances). ISNet is fetched by `make models-all` (npm), which `make test` does
//! not run, so this target is not part of `cargo test` (`test = false`): `make
//! tensorrt-test` runs it, and it fails, saying so, without the model.

mod engine_support;
mod gpu_support;
mod trt_support;

#[test]
fn isnet_engines_match_onnx_runtime() {
    engine_support::engines_match_onnx_runtime(&engine_support::repo("onnx/isnet"));
}
