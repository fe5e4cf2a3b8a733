//! TensorRT engines against ONNX Runtime, end to end on a GPU: U2NetP and the matting
//! fixture are built with `engines::store` into a temporary engines folder, deserialised,
//! and served by `GpuStages` from the engine; the same pipeline with ONNX Runtime for the
//! models is the reference. Precisions: fp32 and fp16 on TensorRT 10, the model's own on
//! 11. (ISNet, fetched by `make models-all`, is tests/tensorrt_engine_isnet.rs.)
//!
//! Tolerances, on the final 8-bit alpha over the photos: fp32 (and TensorRT 11's
//! from-the-model fp32) mean |difference| <= 0.5/255 and IoU of alpha > 127 >= 0.999;
//! fp16 mean <= 2/255 and IoU >= 0.99 (the limits the CPU pipeline is held to against
//! the Python reference on JPEG inputs).
//!
//! Runs in `make test` on the stand-ins (the CUDA driver and TensorRT of tests/, which
//! prove the shim's C++, the engine life cycle, shapes, profiles and buffers; not FP16's
//! numerics or speed, where the stand-in runs the model in float32), and on a GPU machine
//! with the real TensorRT (`make tensorrt-test`, `make gpu-check`): a test that lacks a GPU
//! or TensorRT fails, saying which.
//!
//! Also: an engine with an output of data-dependent shape (NonZero's indices: -1 until the
//! engine runs) is refused when celer loads it, naming the output, rather than bound to a
//! buffer it would overrun; and an engine and an execution context dropped on a thread with
//! no CUDA context current are destroyed in their own (TensorRT frees their device memory
//! through the current context; the stand-in aborts the process otherwise).

mod engine_support;
mod gpu_support;
mod trt_support;

use engine_support::engines_match_onnx_runtime;

#[test]
fn u2netp_engines_match_onnx_runtime() {
    engines_match_onnx_runtime(&engine_support::repo("onnx/u2netp"));
}

#[test]
fn the_matting_model_fixture_runs_from_engines() {
    engines_match_onnx_runtime(&engine_support::repo("onnx/fixtures/classes-matting"));
}

#[test]
fn an_engine_with_an_output_of_data_dependent_shape_is_refused_at_load() {
    let device = gpu_support::gpu();
    let pool = gpu_support::pool(&device);
    let (loaded, _engines) = engine_support::try_stages_on_engines(
        &engine_support::repo("onnx/fixtures/prob-nonzero"),
        celer::replica::gpu::GpuLimits::default(),
        &pool,
    );
    let error = match loaded {
        Ok(_) => panic!("an engine whose output `foreground` has a data-dependent shape loaded"),
        Err(e) => e.to_string(),
    };
    for words in [
        "prob-nonzero (TensorRT): output `foreground` has a data-dependent shape [4, -1]",
        "learns its size only when the engine runs",
        "data-dependent output shapes are not supported",
    ] {
        assert!(error.contains(words), "no `{words}` in: {error}");
    }
}

#[test]
fn an_engine_and_its_context_dropped_on_a_thread_without_a_cuda_context_go_in_their_own() {
    let (mut engines, _dir) =
        engine_support::engines_of(&engine_support::repo("onnx/fixtures/prob-guided"));
    let (_, engine) = engines.pop().expect("the segmentation engine");
    let context = engine
        .create_context()
        .expect("a context with its own memory");
    // A new thread has no current CUDA context, and nothing here binds one: the drops
    // must make the engine's own current themselves.
    std::thread::spawn(move || {
        drop(context);
        drop(engine);
    })
    .join()
    .expect("dropped on another thread");
}
