//! The GPU that the GPU tests run on: the real one where a CUDA driver is installed, and
//! otherwise celer's stand-in driver (tests/cuda_standin), which runs the same kernels on
//! the CPU under a GPU's rules. The tests are the same either way; each binary says once
//! which driver it ran on. A GPU test that cannot get a GPU fails: it never skips.
//!
//! `CELER_TEST_CUDA=real` requires the real driver (a GPU machine's check), `standin`
//! requires the stand-in; unset, the real driver is used when it is there. A stand-in that
//! the loader finds by name (on `LD_LIBRARY_PATH`, as `make gpu-check`'s pack runs here
//! with `run --standin`) is the stand-in, never taken for the real driver.
//! `CELER_TEST_CUDA_DRIVER=12.2` (11.8, 12.4, 12.8, 13.0: the default) runs the stand-in
//! as that CUDA version's driver: it reports that version and lacks the newer entry
//! points. It does not apply to the real driver.

// `unsafe` here: asks cudarc whether the real driver is present; each block says why it is sound.
#![allow(unsafe_code)]
#![allow(dead_code)]

use std::io::Write;
use std::process::Command;
use std::sync::{Arc, OnceLock};

use celer::cuda::{probe, GpuDevice, Probe};
use celer_cuda_standin::StandIn;

pub mod planted;

/// Which CUDA driver this test process runs on.
pub enum Driver {
    Real,
    StandIn(&'static StandIn),
}

impl Driver {
    pub fn standin(&self) -> Option<&'static StandIn> {
        match self {
            Driver::StandIn(s) => Some(s),
            Driver::Real => None,
        }
    }
}

/// The driver, chosen (and the stand-in loaded) on first use, before any CUDA call.
pub fn driver() -> &'static Driver {
    static DRIVER: OnceLock<Driver> = OnceLock::new();
    DRIVER.get_or_init(|| {
        let wanted = std::env::var("CELER_TEST_CUDA").unwrap_or_default();
        // SAFETY: cudarc's check only dlopens the driver library by name and closes it.
        let found = unsafe { cudarc::driver::sys::is_culib_present() };
        // A stand-in on LD_LIBRARY_PATH (a packed GPU check run here) is found by name as
        // a real driver would be: never taken for one.
        let found_standin = found.then(celer_cuda_standin::found_by_name).flatten();
        if let Some(path) = &found_standin {
            // cudarc will load the one found by name: it must be the one loaded here.
            let ours = celer_cuda_standin::library();
            let same = |p: &std::path::Path| std::fs::canonicalize(p).ok();
            assert!(
                wanted == "real" || same(path) == same(&ours),
                "the stand-in CUDA driver the loader finds ({}) is not this build's of CUDA \
                 {} ({}): put {} on LD_LIBRARY_PATH",
                path.display(),
                celer_cuda_standin::version(),
                ours.display(),
                celer_cuda_standin::library_dir().display()
            );
        }
        let standin = || {
            Driver::StandIn(
                StandIn::load().unwrap_or_else(|e| panic!("the stand-in CUDA driver: {e}")),
            )
        };
        let driver = match (wanted.as_str(), found, found_standin.is_some()) {
            ("real", _, true) => panic!(
                "CELER_TEST_CUDA=real, but the CUDA driver the loader finds is celer's stand-in \
                 ({}): a GPU check runs on the real driver only",
                found_standin.unwrap_or_default().display()
            ),
            ("real", false, _) => panic!("CELER_TEST_CUDA=real, but there is no CUDA driver here"),
            ("standin", true, false) => panic!(
                "CELER_TEST_CUDA=standin, but a real CUDA driver is installed and cudarc would \
                 load it first; run with LD_LIBRARY_PATH={}",
                celer_cuda_standin::library_dir().display()
            ),
            (_, true, false) => Driver::Real,
            (_, _, _) => standin(),
        };
        let which = match &driver {
            // The stand-in's version, when one is named, does not apply: said, not hidden.
            Driver::Real => match std::env::var(celer_cuda_standin::VERSION_ENV) {
                Ok(v) if !v.is_empty() => format!(
                    "the real CUDA driver ({}={v} names a stand-in's version: not used)",
                    celer_cuda_standin::VERSION_ENV
                ),
                _ => "the real CUDA driver".to_string(),
            },
            Driver::StandIn(_) => "celer's stand-in CUDA driver (kernels on the CPU)".to_string(),
        };
        // Straight to the terminal, past libtest's capture: the run says what it proved.
        let _ = writeln!(
            std::io::stderr(),
            "GPU tests run on {which}: {}",
            probe().summary()
        );
        driver
    })
}

/// A file of the repository: under `CELER_REPO_ROOT` where the tests run from a packed
/// copy (`make gpu-check`), else in this checkout.
pub fn repo(path: &str) -> std::path::PathBuf {
    std::env::var_os("CELER_REPO_ROOT")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")))
        .join(path)
}

/// GPU 0, opened with its kernels loaded; the test fails when there is none.
pub fn gpu() -> Arc<GpuDevice> {
    static DEVICE: OnceLock<Arc<GpuDevice>> = OnceLock::new();
    DEVICE
        .get_or_init(|| {
            driver();
            match probe() {
                Probe::Ready { gpus, .. } if !gpus.is_empty() => GpuDevice::open(gpus[0].clone())
                    .unwrap_or_else(|e| panic!("the GPU opens and loads the kernels: {e}")),
                other => panic!("no GPU to test on: {}", other.summary()),
            }
        })
        .clone()
}

/// Makes a child process (`celer serve`, ...) use the same driver as this one.
pub fn use_driver(command: &mut Command) -> &mut Command {
    if let Driver::StandIn(_) = driver() {
        let dir = celer_cuda_standin::library_dir();
        let path = match std::env::var_os("LD_LIBRARY_PATH") {
            Some(old) if !old.is_empty() => {
                let mut joined = dir.as_os_str().to_owned();
                joined.push(":");
                joined.push(old);
                joined
            }
            _ => dir.as_os_str().to_owned(),
        };
        command.env("LD_LIBRARY_PATH", path);
    }
    command
}

/// A page-locked host pool for `dev`'s requests (as a server makes one), attached to its
/// context: what `GpuStages::load` downloads into.
pub fn blocks(dev: &Arc<GpuDevice>) -> celer::pixels::SharedAlloc {
    Arc::new(pool(dev))
}

/// As `blocks`, the pool itself: one replica's, for images up to the default limits.
pub fn pool(dev: &Arc<GpuDevice>) -> celer::cuda::HostPool {
    let max = celer::replica::gpu::GpuLimits::default().max_pixels;
    let pool = celer::replica::gpu::host_pool(1, max, celer::replica::gpu::DEFAULT_BLOCK_PIXELS);
    pool.attach(dev.context());
    pool
}

/// A test image as a request's decoded pixels (on the heap).
pub fn pixels(image: &image::RgbImage) -> Arc<celer::pixels::RgbPixels> {
    Arc::new(celer::pixels::from_image(image.clone()))
}

/// Queues `image` on `router` as the server does, priced by its size
/// (`MatteScheduler::submit_priced`), and with an hour to run in, so that what is checked is what the device computes, not
/// what admission makes of a machine slowed by the tests beside it.
pub fn submit(
    router: &celer::replica::MatteScheduler,
    image: &Arc<celer::pixels::RgbPixels>,
    planes: celer::matte::Planes,
) -> Result<celer::sched::Ticket<celer::replica::BoxedMatteExecutor>, celer::sched::SubmitError> {
    let job = celer::replica::MatteJob::new(image.clone(), Default::default(), planes);
    router.submit_priced(
        job,
        std::time::Instant::now() + std::time::Duration::from_secs(3600),
    )
}

/// A plane a GPU handed back, as a heap image to compare with the CPU's.
pub fn plane<P: image::Pixel<Subpixel = u8>>(
    plane: &Option<image::ImageBuffer<P, celer::pixels::HostBytes>>,
) -> Option<image::ImageBuffer<P, Vec<u8>>> {
    plane.clone().map(celer::pixels::into_image)
}

/// The prob-guided fixture's pipeline served on GPU `info` by `replicas` replicas (its
/// models on ONNX Runtime: no TensorRT), the pixels in `pool`, loaded.
pub fn serve_prob_guided(
    info: &celer::cuda::GpuInfo,
    replicas: usize,
    pool: celer::cuda::HostPool,
) -> celer::replica::MatteScheduler {
    let dir = repo("onnx/fixtures/prob-guided");
    let spec = celer::spec::PipelineSpec::load_dir(&dir).expect("fixture");
    let plans = celer::engines::plan::plan_gpus(
        &spec,
        &dir,
        &celer::engines::dirs::EngineDirs::resolve(&dir, None, false).unwrap(),
        std::slice::from_ref(info),
        false,
        None,
    )
    .expect("plan");
    let setup = celer::replica::gpu::gpu_device_setup(
        &spec,
        plans.into_iter().next().unwrap(),
        replicas,
        1,
        celer::replica::gpu::GpuServing::new(
            celer::replica::gpu::GpuLimits {
                max_pixels: 1 << 20,
                max_side_px: 2048,
            },
            pool,
        ),
    );
    let router = celer::sched::Scheduler::start(
        vec![setup],
        celer::sched::SchedulerConfig {
            health_check_interval: std::time::Duration::from_millis(100),
            ..Default::default()
        },
    );
    router.wait_ready().expect("the GPU replicas load");
    router
}
