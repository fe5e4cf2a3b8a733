//! A CUDA fault that surfaces inside TensorRT's `enqueueV3`, as a GPU replica's stages
//! meet it: an enqueue TensorRT refuses fails that request only (the stages serve the next
//! one); an enqueue whose kernel hits an illegal address (the stand-in TensorRT's
//! `enqueue-sticky` fault) makes the context's error sticky, and the stages say so at once
//! (`GpuError::is_device_lost`, from the enqueue's own failure), so that the scheduler
//! takes the device out at that request, not at the next one's synchronisation.
//!
//! A binary of its own: it loses GPU 0's context, which the other tests of a binary would
//! share; and, its only test, it sets the stand-in's fault file in its environment before
//! anything reads it. Stand-in only (the faults are injected through it): on real TensorRT
//! it fails, saying so.

mod engine_support;
mod gpu_support;
mod trt_support;

use celer::matte::{Planes, StageTimings};
use celer::replica::gpu::{GpuError, GpuLimits, GpuStages};
use image::{Rgb, RgbImage};

#[test]
fn a_sticky_error_inside_enqueue_loses_the_device_and_a_refused_enqueue_does_not() {
    let armed = tempfile::tempdir().unwrap();
    let fault = armed.path().join("tensorrt-fault");
    // Before any library reads the environment: nothing else runs in this process yet.
    std::env::set_var("CELER_TRT_STANDIN_FAULT_FILE", &fault);
    assert!(
        trt_support::is_standin(),
        "this test injects faults through the stand-in TensorRT (CELER_TEST_CUDA=standin)"
    );
    let device = gpu_support::gpu();
    let pool = gpu_support::pool(&device);
    let (mut stages, engines) = engine_support::stages_on_engines(
        &engine_support::repo("onnx/fixtures/prob-guided"),
        GpuLimits::default(),
        &pool,
    );
    let image = gpu_support::pixels(&RgbImage::from_fn(96, 80, |x, _| {
        Rgb([if x < 48 { 220 } else { 30 }, 120, 40])
    }));
    let run = |stages: &mut GpuStages| -> Result<Vec<u8>, GpuError> {
        let out = stages.run(&image, Planes::ALPHA, &mut StageTimings::default())?;
        Ok(gpu_support::plane(&out.alpha).expect("alpha").into_raw())
    };
    let before = run(&mut stages).expect("served before the faults");

    std::fs::write(&fault, "enqueue").unwrap();
    let refused = run(&mut stages).expect_err("an enqueue TensorRT refuses fails its request");
    assert!(!fault.exists(), "the fault was taken");
    assert!(
        refused.to_string().contains("enqueueV3") && !refused.is_device_lost(),
        "a refused enqueue is its request's failure, not the device's: {refused}"
    );
    assert_eq!(
        run(&mut stages).expect("the next request is served"),
        before
    );

    std::fs::write(&fault, "enqueue-sticky").unwrap();
    let lost = run(&mut stages).expect_err("the engine's kernel hit an illegal address");
    assert!(!fault.exists(), "the fault was taken");
    assert!(
        lost.is_device_lost(),
        "a sticky error inside enqueueV3 loses the device at once: {lost}"
    );
    let text = lost.to_string();
    assert!(
        text.contains("enqueueV3 failed") && text.contains("CUDA_ERROR_ILLEGAL_ADDRESS"),
        "{text}"
    );
    // The device is lost with TensorRT's state in its context: no TensorRT call may touch
    // it again (the stand-in's relaunch rule aborts on one), so the stages and the engines
    // are left alive, as celer leaves a GPU lost for good, for the process to end.
    std::mem::forget(stages);
    std::mem::forget(engines);
}
