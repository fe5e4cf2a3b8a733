//! CUDA driver codes beyond the bindings: a driver newer than celer's headers answers
//! codes celer may not know (Hopper's `CUDA_ERROR_CONTAINED`, 226, from CUDA 12.8; and
//! whatever later drivers add). celer reads every code as an integer (src/cuda/driver),
//! and a GPU that meets one on the request path must fail the request with an error that
//! names the code and counts as a lost device (the context cannot be trusted), never
//! panic, and come back through recovery.
//!
//! The codes are injected by the stand-in driver (`StandIn::inject_return`): 226 where the
//! stand-in plays a driver that defines it (12.8, 13.0; at 12.2 it refuses, and the test
//! checks that), and 1000, in no cuda.h, at every version; each at an upload, a launch, a
//! stream synchronisation and an event record, through `GpuStages` and through a served
//! GPU device. A real driver cannot be made to answer a chosen code: those tests fail
//! there, saying so; how the driver names (or cannot name) a code is checked on either.
//!
//! A binary of its own: each case loses GPU 0's context, which must be destroyed (every
//! reference dropped) before the next case opens a fresh one.

mod gpu_support;

use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use celer::cuda::driver::{code, result, Device, DriverError};
use celer::cuda::{probe, CudaVersion, GpuDevice};
use celer::matte::{Planes, StageTimings};
use celer::replica::gpu::{GpuLimits, GpuStages, ModelSource};
use celer::replica::MatteScheduler;
use celer::sched::metrics::DeviceLabel;
use celer::spec::PipelineSpec;
use celer_cuda_standin::StandIn;
use image::RgbImage;

/// The request path's entry points the codes are injected at: an upload, a launch, a
/// stream synchronisation, an event.
const ENTRY_POINTS: [&str; 4] = [
    "cuMemcpyHtoDAsync_v2",
    "cuLaunchKernel",
    "cuStreamSynchronize",
    "cuEventRecord",
];

/// A code in no cuda.h: what a driver newer than every header celer knows may answer.
const UNKNOWN: u32 = 1000;

/// One test at a time: they share GPU 0's primary context (which the cases lose and
/// destroy) and the stand-in's armed codes.
fn serial() -> MutexGuard<'static, ()> {
    static ONE: Mutex<()> = Mutex::new(());
    ONE.lock().unwrap_or_else(|p| p.into_inner())
}

fn standin() -> &'static StandIn {
    gpu_support::driver().standin().unwrap_or_else(|| {
        panic!(
            "these tests make the driver answer chosen codes, which only celer's stand-in \
             driver can (a real one answers what its GPU does): run them without a CUDA \
             driver installed, or with CELER_TEST_CUDA unset on a machine without one"
        )
    })
}

fn driver_version() -> CudaVersion {
    probe::driver_version().expect("the driver's version")
}

/// The codes to inject at this driver version: 226 where the version defines it (and
/// the stand-in refuses it elsewhere, as such a driver never returns it), 1000 always.
fn codes_here() -> Vec<u32> {
    let standin = standin();
    let contained = code::CUDA_ERROR_CONTAINED;
    if driver_version() >= CudaVersion::new(12, 8) {
        vec![contained, UNKNOWN]
    } else {
        let refused = standin
            .inject_return("cuStreamSynchronize", contained, 1)
            .expect_err("a driver older than 12.8 never returns 226");
        assert!(refused.contains("is CUDA 12.8's"), "{refused}");
        vec![UNKNOWN]
    }
}

/// What an error of `code` must say, on this driver.
fn names(code: u32) -> String {
    if code == UNKNOWN {
        format!("unknown CUDA error code {code}")
    } else {
        format!("CUDA_ERROR_CONTAINED ({code})")
    }
}

fn pipeline() -> (PipelineSpec, std::path::PathBuf) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("onnx/fixtures/prob-guided");
    (PipelineSpec::load_dir(&dir).expect("fixture"), dir)
}

fn image() -> Arc<celer::pixels::RgbPixels> {
    Arc::new(celer::pixels::from_image(RgbImage::from_fn(
        301,
        203,
        |x, y| image::Rgb([(x % 256) as u8, (y % 256) as u8, ((x + y) % 256) as u8]),
    )))
}

/// Whether GPU 0's primary context exists (celer or anyone still retains it).
fn context_alive() -> bool {
    Device::get(0)
        .and_then(|d| d.primary_context_state())
        .expect("the primary context's state")
        .active
}

#[test]
fn the_driver_names_a_code_only_where_its_version_defines_it() {
    let _one = serial();
    // No injection: this holds on a real driver as on the stand-in.
    gpu_support::driver();
    let lost = |code| DriverError::Code {
        call: "cuStreamSynchronize",
        code,
    };
    // In no cuda.h: the driver cannot name it, celer says so and counts it lost.
    let unknown = lost(UNKNOWN);
    assert!(unknown.is_device_lost());
    assert_eq!(
        unknown.to_string(),
        "cuStreamSynchronize: unknown CUDA error code 1000"
    );
    let contained = lost(code::CUDA_ERROR_CONTAINED);
    assert!(contained.is_device_lost());
    let text = contained.to_string();
    if driver_version() >= CudaVersion::new(12, 8) {
        assert!(
            text.starts_with("cuStreamSynchronize: CUDA_ERROR_CONTAINED (226): "),
            "{text}"
        );
    } else {
        // celer knows it; this driver does not, and the text says both.
        assert!(
            text.contains("CUDA_ERROR_CONTAINED (226; the driver does not know it"),
            "{text}"
        );
    }
    // A code every driver defines, for contrast: named by the driver, not lost.
    let usable = lost(code::CUDA_ERROR_OUT_OF_MEMORY);
    assert!(!usable.is_device_lost());
    assert!(
        usable
            .to_string()
            .contains("CUDA_ERROR_OUT_OF_MEMORY (2): out of memory"),
        "{usable}"
    );
    assert_eq!(result::describe(0), "CUDA_SUCCESS (0): no error");
}

#[test]
fn gpu_stages_meet_each_injected_code_as_a_lost_device() {
    let _one = serial();
    let standin = standin();
    let (spec, _) = pipeline();
    let info = probe().gpus().first().cloned().expect("a GPU");
    let image = image();
    for code in codes_here() {
        for entry in ENTRY_POINTS {
            let case = format!("{code} at {entry}");
            let device = GpuDevice::open(info.clone()).expect("the GPU opens");
            let blocks = gpu_support::blocks(&device);
            let mut stages = GpuStages::load(
                &spec,
                device,
                ModelSource::OnnxRuntime { intra_threads: 1 },
                GpuLimits {
                    max_pixels: 1 << 20,
                    max_side_px: 2048,
                },
                blocks,
            )
            .expect("the stages load");
            stages
                .run(&image, Planes::ALL, &mut StageTimings::default())
                .unwrap_or_else(|e| panic!("{case}: before the injection: {e}"));

            standin.inject_return(entry, code, 1).expect("armed");
            let err = stages
                .run(&image, Planes::ALL, &mut StageTimings::default())
                .expect_err(&case);
            let text = err.to_string();
            assert!(err.is_device_lost(), "{case}: not a lost device: {text}");
            assert!(
                text.contains(entry) && text.contains(&names(code)),
                "{case}: {text}"
            );
            // Sticky: the next request in the context fails the same way.
            let again = stages
                .run(&image, Planes::ALL, &mut StageTimings::default())
                .expect_err(&case);
            assert!(again.is_device_lost(), "{case}: {again}");
            assert!(again.to_string().contains(&names(code)), "{case}: {again}");
            // celer's last reference destroys the lost context.
            drop(stages);
            assert!(!context_alive(), "{case}: the lost context outlived celer");
        }
    }
}

/// One request through the scheduler: refused (no healthy device, while the GPU is
/// reopened) or failed, as the error's text. A panic in the replica fails the test.
fn serve(router: &MatteScheduler, image: &Arc<celer::pixels::RgbPixels>) -> Result<(), String> {
    let waiter = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let ticket = gpu_support::submit(router, image, Planes::ALL).map_err(|e| e.to_string())?;
    match waiter.block_on(ticket.wait()) {
        Ok(_) => Ok(()),
        Err(e @ celer::sched::JobError::Panicked { .. }) => panic!("{e}"),
        Err(e) => Err(e.to_string()),
    }
}

/// What celer logs in this process, kept for the tests to read: a worker's account of a
/// lost device says which error lost it (the request itself may end as failed over and
/// refused, its text then without the driver's error).
#[derive(Clone, Default)]
struct Log(Arc<Mutex<Vec<u8>>>);

impl Log {
    /// Installed once per process.
    fn installed() -> &'static Log {
        static LOG: OnceLock<Log> = OnceLock::new();
        LOG.get_or_init(|| {
            let log = Log::default();
            let _ = tracing_subscriber::fmt()
                .with_env_filter("celer=info")
                .with_ansi(false)
                .with_writer(log.clone())
                .try_init();
            log
        })
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap_or_else(|p| p.into_inner())).into_owned()
    }
}

impl std::io::Write for Log {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Log {
    type Writer = Log;

    fn make_writer(&'a self) -> Log {
        self.clone()
    }
}

#[test]
fn a_served_gpu_meeting_an_injected_code_fails_the_request_and_is_reopened() {
    let _one = serial();
    let log = Log::installed();
    let standin = standin();
    let info = probe().gpus().first().cloned().expect("a GPU");
    let router = gpu_support::serve_prob_guided(
        &info,
        1,
        celer::replica::gpu::host_pool(1, 1 << 20, 1 << 20),
    );
    let image = image();
    serve(&router, &image).expect("served before any injection");
    let recoveries = || {
        router
            .metrics()
            .recoveries
            .get_or_create(&DeviceLabel {
                device: "gpu0".to_string(),
            })
            .get()
    };
    let mut lost = 0;
    for code in codes_here() {
        for entry in ENTRY_POINTS {
            let case = format!("{code} at {entry}");
            let logged = log.text().len();
            standin.inject_return(entry, code, 1).expect("armed");
            let answer = serve(&router, &image).expect_err(&case);
            // Failed, naming the code; or failed over and refused (the GPU being reopened).
            assert!(
                answer.contains(&names(code)) || answer.contains("fail-over refused"),
                "{case}: {answer}"
            );
            lost += 1;
            // A lost device is reopened: the next requests succeed once it is back.
            let deadline = Instant::now() + Duration::from_secs(120);
            while serve(&router, &image).is_err() {
                assert!(
                    Instant::now() < deadline,
                    "{case}: the GPU did not come back: {:?}",
                    router.devices()
                );
                std::thread::sleep(Duration::from_millis(100));
            }
            assert_eq!(recoveries(), lost, "{case}: one loss, one recovery");
            let account = log.text()[logged..].to_string();
            let reopening = account
                .lines()
                .find(|line| line.contains("device lost: reopening it"))
                .unwrap_or_else(|| panic!("{case}: no loss logged: {account}"));
            assert!(
                reopening.contains(entry) && reopening.contains(&names(code)),
                "{case}: {reopening}"
            );
        }
    }
    router.shutdown();
}
