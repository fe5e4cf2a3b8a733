//! A GPU whose CUDA context fails is reopened without a restart. A kernel that writes to
//! an address no allocation holds, launched in GPU 0's primary context (the one celer's
//! replicas share), makes the context's error sticky, as any illegal address on a GPU
//! does: the replicas' next run fails, the device is marked unhealthy, reopened (every
//! replica's stream, buffers and the context itself dropped and made again) and, once a
//! probe passes, serves again. The same on the real driver and on the stand-in.
//!
//! A binary of its own: the other GPU tests hold GPU 0's context for their whole process,
//! which would keep the failed context alive.

// `unsafe` here: calls the CUDA driver directly; each block says why it is sound.
#![allow(unsafe_code)]

mod gpu_support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use celer::cuda::driver::{code, CudaContext, LaunchConfig, PushKernelArg};
use celer::cuda::probe;
use celer::engines::dirs::EngineDirs;
use celer::engines::plan::plan_gpus;
use celer::matte::Planes;
use celer::replica::gpu::{gpu_device_setup, GpuLimits};
use celer::replica::MatteScheduler;
use celer::sched::metrics::DeviceLabel;
use celer::sched::{Scheduler, SchedulerConfig};
use celer::spec::PipelineSpec;
use image::{GrayImage, RgbImage};

fn serve(
    router: &MatteScheduler,
    image: &Arc<celer::pixels::RgbPixels>,
) -> Result<GrayImage, String> {
    let waiter = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let ticket = gpu_support::submit(router, image, Planes::ALL).map_err(|e| e.to_string())?;
    waiter
        .block_on(ticket.wait())
        .map_err(|e| e.to_string())
        .and_then(|done| {
            done.output
                .planes
                .alpha
                .map(celer::pixels::into_image)
                .ok_or_else(|| "no alpha".to_string())
        })
}

/// Loses GPU 0's context: a kernel of this test writes to an unmapped address in it.
fn lose_the_context() {
    let info = probe().gpus()[0].clone();
    let context = CudaContext::new(0).expect("GPU 0's primary context");
    // NVRTC's, or precompiled on a GPU machine without NVRTC (`make gpu-check`).
    let planted = gpu_support::planted::cubin(
        info.arch(),
        celer::cuda::probe::driver_version().expect("the driver's version"),
    )
    .unwrap_or_else(|e| panic!("the test kernels: {e}"));
    let module = context.load_module(&planted.cubin).unwrap();
    let kernel = module.load_function("write_to_address").unwrap();
    let stream = context.new_stream().unwrap();
    let (address, value) = (16u64, 1u32);
    let mut launch = stream.launch_builder(&kernel);
    launch.arg(&address).arg(&value);
    // SAFETY: the arguments match write_to_address(u64, u32); the illegal write is the
    // point: it must make the context's error sticky.
    let queued = unsafe {
        launch.launch(LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (32, 1, 1),
            shared_mem_bytes: 0,
        })
    };
    let error = queued
        .and_then(|_| stream.synchronize())
        .expect_err("a write to address 16 is illegal");
    assert_eq!(error.code(), Some(code::CUDA_ERROR_ILLEGAL_ADDRESS));
    // Dropped here: from now on only celer's replicas hold the failed context.
}

#[test]
fn a_gpu_whose_context_fails_is_reopened_and_serves_again() {
    // The workers' account of the loss and the recovery, in the output of a failure.
    let _ = tracing_subscriber::fmt()
        .with_env_filter("celer=info")
        .with_test_writer()
        .try_init();
    let driver = gpu_support::driver();
    let info = probe().gpus().first().cloned().expect("a GPU");
    let dir = gpu_support::repo("onnx/fixtures/prob-guided");
    let spec = PipelineSpec::load_dir(&dir).expect("fixture");
    let plans = plan_gpus(
        &spec,
        &dir,
        &EngineDirs::resolve(&dir, None, false).unwrap(),
        std::slice::from_ref(&info),
        false,
        None,
    )
    .expect("plan");
    let setup = gpu_device_setup(
        &spec,
        plans.into_iter().next().unwrap(),
        2,
        1,
        celer::replica::gpu::GpuServing::new(
            GpuLimits {
                max_pixels: 1 << 20,
                max_side_px: 2048,
            },
            celer::replica::gpu::host_pool(2, 1 << 20, 1 << 20),
        ),
    );
    let router = Scheduler::start(
        vec![setup],
        SchedulerConfig {
            health_check_interval: Duration::from_millis(100),
            ..Default::default()
        },
    );
    router.wait_ready().expect("the GPU replicas load");
    let image = Arc::new(celer::pixels::from_image(RgbImage::from_fn(
        333,
        517,
        |x, y| {
            let v = if (80..250).contains(&x) && (120..400).contains(&y) {
                220
            } else {
                25
            };
            image::Rgb([v, (x % 256) as u8, (y % 256) as u8])
        },
    )));
    let before = serve(&router, &image).expect("served before the failure");
    let contexts = driver.standin().map(|s| s.counter("contexts_created"));

    lose_the_context();
    let failed = serve(&router, &image);
    assert!(
        failed.is_err(),
        "a request in the lost context cannot succeed"
    );
    let deadline = Instant::now() + Duration::from_secs(120);
    let after = loop {
        if let Ok(alpha) = serve(&router, &image) {
            break alpha;
        }
        assert!(
            Instant::now() < deadline,
            "the GPU did not come back: {:?}",
            router.devices()
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(after, before, "the reopened GPU gives the same alpha");
    let recoveries = router
        .metrics()
        .recoveries
        .get_or_create(&DeviceLabel {
            device: "gpu0".to_string(),
        })
        .get();
    assert_eq!(recoveries, 1, "one loss, one recovery");
    if let (Some(standin), Some(before)) = (driver.standin(), contexts) {
        assert!(
            standin.counter("contexts_created") > before,
            "the failed context was destroyed and a new one made"
        );
    }
    router.shutdown();
}
