//! A GPU whose CUDA context fails is reopened without a restart. A kernel that writes to
//! an address no allocation holds, launched in GPU 0's primary context (the one celer's
//! replicas share), makes the context's error sticky, as any illegal address on a GPU
//! does: the replicas' next run fails, the device is marked unhealthy, reopened (every
//! replica's stream, buffers and the context itself dropped and made again) and, once a
//! probe passes, serves again. The same on the real driver and on the stand-in.
//!
//! A binary of its own: the other GPU tests hold GPU 0's context for their whole process,
//! which would keep the failed context alive.
//!
//! With two GPUs sharing the page-locked pixel pool, GPU 0's loss and recovery (and its
//! closing for good) leave GPU 1's copies DMA from the pool: the pool is registered in a
//! context of its own, which no recovery resets (docs/gpu.md).

// `unsafe` here: calls the CUDA driver directly; each block says why it is sound.
#![allow(unsafe_code)]

mod gpu_support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use celer::codec::decode::{decode_into, DecodeLimits};
use celer::cuda::driver::{code, CudaContext, LaunchConfig, PushKernelArg};
use celer::cuda::{probe, HostPool};
use celer::matte::Planes;
use celer::pixels::RgbPixels;
use celer::replica::MatteScheduler;
use celer::sched::metrics::DeviceLabel;
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

fn test_image() -> RgbImage {
    RgbImage::from_fn(333, 517, |x, y| {
        let v = if (80..250).contains(&x) && (120..400).contains(&y) {
            220
        } else {
            25
        };
        image::Rgb([v, (x % 256) as u8, (y % 256) as u8])
    })
}

/// Loses GPU 0's context under `router` (GPU 0's only device) and waits until a request
/// is served again: the alpha served then.
fn lose_and_recover(router: &MatteScheduler, image: &Arc<RgbPixels>) -> GrayImage {
    lose_the_context();
    let failed = serve(router, image);
    assert!(
        failed.is_err(),
        "a request in the lost context cannot succeed"
    );
    let deadline = Instant::now() + Duration::from_secs(120);
    let after = loop {
        if let Ok(alpha) = serve(router, image) {
            break alpha;
        }
        assert!(
            Instant::now() < deadline,
            "the GPU did not come back: {:?}",
            router.devices()
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    let recoveries = router
        .metrics()
        .recoveries
        .get_or_create(&DeviceLabel {
            device: "gpu0".to_string(),
        })
        .get();
    assert_eq!(recoveries, 1, "one loss, one recovery");
    after
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
    let router = gpu_support::serve_prob_guided(
        &info,
        2,
        celer::replica::gpu::host_pool(2, 1 << 20, 1 << 20),
    );
    let image = Arc::new(celer::pixels::from_image(test_image()));
    let before = serve(&router, &image).expect("served before the failure");
    let contexts = driver.standin().map(|s| s.counter("contexts_created"));

    let after = lose_and_recover(&router, &image);
    assert_eq!(after, before, "the reopened GPU gives the same alpha");
    if let (Some(standin), Some(before)) = (driver.standin(), contexts) {
        assert!(
            standin.counter("contexts_created") > before,
            "the failed context was destroyed and a new one made"
        );
    }
    router.shutdown();
}

/// Set in the process that gpu_1_copies_stay_dma_through_gpu_0s_recovery starts: two
/// stand-in GPUs.
const TWO_GPUS: &str = "CELER_TEST_GPU_RECOVERY_TWO_GPUS";

/// `image` decoded into `pool`, as a server's decoder writes a request's pixels.
fn decoded(image: &RgbImage, pool: &HostPool) -> Arc<RgbPixels> {
    let mut png = std::io::Cursor::new(Vec::new());
    image
        .write_to(&mut png, image::ImageFormat::Png)
        .expect("PNG");
    let pixels = decode_into(png.get_ref(), &DecodeLimits::default(), pool).expect("decoded");
    assert!(pixels.as_raw().is_leased(), "decoded into a pool block");
    Arc::new(pixels)
}

/// A request on `router` from the pool: its alpha, its pageable copies, and those of them
/// whose registration ended with its context.
fn serve_counted(
    standin: &celer_cuda_standin::StandIn,
    router: &MatteScheduler,
    image: &Arc<RgbPixels>,
) -> (GrayImage, u64, u64) {
    let pageable = || {
        let c = standin.counters();
        (
            c.pageable_htod_copies + c.pageable_dtoh_copies,
            c.pageable_after_context_end,
        )
    };
    let before = pageable();
    let alpha = serve(router, image).expect("GPU 1 serves");
    let after = pageable();
    (alpha, after.0 - before.0, after.1 - before.1)
}

/// Two GPUs share the pixel pool, GPU 0 opened first (where the pool's blocks are
/// page-locked). GPU 0's context is lost and recovered in process, then GPU 0 closes for
/// good (as a GPU whose reopen failed): through both, GPU 1's copies stay DMA from the
/// pool, counted by the stand-in (rule "registration ended with its context" counts a
/// copy whose registration ended with GPU 0's primary context).
#[test]
fn gpu_1_copies_stay_dma_through_gpu_0s_recovery() {
    let name = "gpu_1_copies_stay_dma_through_gpu_0s_recovery";
    if std::env::var(TWO_GPUS).is_err() {
        // The stand-in reads its GPU count at cuInit: a process of its own.
        assert!(
            gpu_support::driver().standin().is_some(),
            "this test needs two GPUs: it runs on the stand-in's"
        );
        celer_cuda_standin::run_test_in_child(
            name,
            &[(TWO_GPUS, "1"), ("CELER_CUDA_STANDIN_DEVICES", "2")],
        );
        return;
    }
    let _ = tracing_subscriber::fmt()
        .with_env_filter("celer=info")
        .with_test_writer()
        .try_init();
    let standin = gpu_support::driver().standin().expect("the stand-in");
    let gpus = probe().gpus().to_vec();
    assert_eq!(gpus.len(), 2, "two stand-in GPUs");
    let pool = celer::replica::gpu::host_pool(2, 1 << 20, 1 << 20);
    let gpu0 = gpu_support::serve_prob_guided(&gpus[0], 1, pool.clone());
    let gpu1 = gpu_support::serve_prob_guided(&gpus[1], 1, pool.clone());
    let image = decoded(&test_image(), &pool);

    // The pixels' upload and every download are DMA from and into the pool's blocks; the
    // one staged copy is the upload of ONNX Runtime's output (the heap's), by design.
    let (before, staged, ended) = serve_counted(standin, &gpu1, &image);
    assert_eq!((staged, ended), (1, 0), "GPU 1 copies DMA from the pool");
    assert_eq!(serve(&gpu0, &image).expect("GPU 0 serves"), before);

    let recovered = lose_and_recover(&gpu0, &image);
    assert_eq!(recovered, before, "the reopened GPU 0 gives the same alpha");
    let (alpha, pageable, ended) = serve_counted(standin, &gpu1, &image);
    assert_eq!(alpha, before);
    assert_eq!(
        (pageable, ended),
        (staged, 0),
        "after GPU 0's recovery, GPU 1 still copies DMA from the pool: {}",
        standin.last_note()
    );

    // GPU 0 closes for good: its primary context is destroyed (a reset where another
    // holder keeps it, as recovery does).
    gpu0.shutdown();
    drop(gpu0);
    celer::cuda::device::reset_if_held(gpus[0].ordinal).expect("GPU 0's context ends");
    let (alpha, pageable, ended) = serve_counted(standin, &gpu1, &image);
    assert_eq!(alpha, before);
    assert_eq!(
        (pageable, ended),
        (staged, 0),
        "with GPU 0 closed, GPU 1 still copies DMA from the pool: {}",
        standin.last_note()
    );
    gpu1.shutdown();
}
