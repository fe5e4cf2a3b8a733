//! The stand-in CUDA driver has teeth. Each test plants one bug of a kind that a GPU
//! shows (in a test kernel of tests/cuda_standin/kernels/planted.cu, or in the test's own
//! launch; never in celer) and checks that the stand-in catches it and says where; each
//! also runs the correct twin, which must pass, so that a stand-in that refused
//! everything would fail here too.
//!
//! These test the stand-in itself, so they run on it even where a GPU exists (a real
//! GPU shows these bugs as wrong answers or nothing at all, which is the point).

// `unsafe` here: plants misuse of the CUDA driver and kernels; each block says why it is sound.
#![allow(unsafe_code)]

use std::sync::{Arc, Mutex, MutexGuard};

use celer::cuda::kernels::COMPILE_OPTIONS;
use celer::cuda::nvrtc::{Nvrtc, Source};
use celer::cuda::Arch;
use celer_cuda_standin::{Fault, StandIn, PLANTED_KERNELS};
use cudarc::driver::sys::CUresult;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaStream, DriverError, LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::Ptx;

/// One test at a time: a sticky error poisons the shared primary context, and each test
/// ends by releasing it, so the next one starts on a fresh context.
fn serial() -> MutexGuard<'static, ()> {
    static ONE: Mutex<()> = Mutex::new(());
    ONE.lock().unwrap_or_else(|p| p.into_inner())
}

/// The stand-in, loaded before any CUDA call of this process.
fn standin() -> &'static StandIn {
    static LOADED: std::sync::OnceLock<&'static StandIn> = std::sync::OnceLock::new();
    LOADED.get_or_init(|| {
        // SAFETY: cudarc's check only dlopens the driver library by name and closes it.
        let real = unsafe { cudarc::driver::sys::is_culib_present() };
        assert!(
            !real,
            "a real CUDA driver is installed, and cudarc would load it: these tests are of the stand-in"
        );
        StandIn::load().expect("the stand-in driver loads")
    })
}

struct Gpu {
    standin: &'static StandIn,
    stream: Arc<CudaStream>,
    context: Arc<CudaContext>,
    module: Arc<cudarc::driver::CudaModule>,
}

impl Gpu {
    fn new() -> Gpu {
        let standin = standin();
        let context = CudaContext::new(0).expect("the stand-in's GPU 0");
        let cubin =
            Nvrtc::for_driver(celer::cuda::probe::driver_version().expect("the driver's version"))
                .expect("NVRTC (make python)")
                .compile_cubin(
                    &Source {
                        name: "planted.cu",
                        text: PLANTED_KERNELS,
                        headers: &[],
                    },
                    Arch::new(9, 0),
                    &COMPILE_OPTIONS,
                )
                .expect("the planted kernels compile");
        let module = context
            .load_module(Ptx::from_binary(cubin))
            .expect("the stand-in loads NVRTC's CUBIN");
        let stream = context.new_stream().expect("a stream");
        standin.clear_last_error();
        Gpu {
            standin,
            stream,
            context,
            module,
        }
    }

    fn kernel(&self, name: &str) -> CudaFunction {
        self.module.load_function(name).expect("kernel in module")
    }
}

fn blocks(threads: u32, block: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (threads.div_ceil(block), 1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn code(e: &DriverError) -> CUresult {
    e.0
}

/// Scalars in zero-padded 8-byte slots: what a pointer parameter reads from a scalar's
/// address (8 bytes) is then known, instead of the stack's neighbouring bytes.
#[repr(C, align(8))]
struct Slot<T: Copy>(T, u32);

#[test]
fn swapped_arguments_are_refused_at_launch_naming_the_parameter() {
    let _one = serial();
    let gpu = Gpu::new();
    let s = &gpu.stream;
    let n = Slot(1000u32, 0);
    let factor = Slot(2.5f32, 0);
    let input: Vec<f32> = (0..1000).map(|i| i as f32).collect();
    let src = s.clone_htod(&input).unwrap();
    let mut dst = s.alloc_zeros::<f32>(1000).unwrap();
    let scale = gpu.kernel("scale");

    // The right order: scale(src, n, factor, dst).
    let mut launch = s.launch_builder(&scale);
    launch.arg(&src).arg(&n.0).arg(&factor.0).arg(&mut dst);
    // SAFETY: the arguments match scale's signature; the buffers hold n floats.
    unsafe { launch.launch(blocks(1000, 256)) }.expect("the correct launch");
    let got = s.clone_dtoh(&dst).unwrap();
    assert_eq!(got[999], 999.0 * 2.5);

    // Planted: n and src swapped.
    let mut launch = s.launch_builder(&scale);
    launch.arg(&n.0).arg(&src).arg(&factor.0).arg(&mut dst);
    // SAFETY: deliberately wrong: the stand-in must refuse it before anything runs.
    let err = unsafe { launch.launch(blocks(1000, 256)) }.expect_err("the swap is caught");
    assert_eq!(code(&err), CUresult::CUDA_ERROR_INVALID_VALUE);
    let why = gpu.standin.last_error();
    assert!(
        why.contains("parameter 0 of scale(const float* src") && why.contains("not device memory"),
        "{why}"
    );
    // Refused at launch, not sticky: the context still works.
    s.synchronize().expect("the context is usable");
}

#[test]
fn a_download_read_before_its_stream_is_synchronised_reads_garbage() {
    let _one = serial();
    let gpu = Gpu::new();
    let s = &gpu.stream;
    let input: Vec<f32> = (0..4096).map(|i| i as f32).collect();
    let src = s.clone_htod(&input).unwrap();
    let mut dst = s.alloc_zeros::<f32>(4096).unwrap();
    let want: Vec<f32> = input.iter().map(|v| v * 0.5).collect();
    let mut staging = celer::cuda::pinned::<u8>(&gpu.context, 4096 * 4, false).unwrap();

    let scale = gpu.kernel("scale");
    let (n, factor) = (4096u32, 0.5f32);
    let mut launch = s.launch_builder(&scale);
    launch.arg(&src).arg(&n).arg(&factor).arg(&mut dst);
    // SAFETY: the arguments match scale's signature; the buffers hold n floats.
    unsafe { launch.launch(blocks(4096, 256)) }.unwrap();
    let host: &mut [f32] =
        bytemuck::cast_slice_mut(staging.as_mut_slice().expect("pinned staging"));
    s.memcpy_dtoh(&dst, host).unwrap();
    // Planted: read the pinned destination before the stream is synchronised.
    let early: Vec<f32> = host.to_vec();
    assert_ne!(early, want, "read before the sync: must not be the result");
    assert!(
        early.iter().all(|v| v.to_bits() == 0xCBCB_CBCB),
        "the stand-in fills a queued download's pinned destination with 0xCB bytes"
    );
    // The twin: synchronise first.
    s.synchronize().unwrap();
    assert_eq!(host.to_vec(), want);
}

#[test]
fn a_write_past_an_allocation_is_an_illegal_address_and_sticky() {
    let _one = serial();
    let contexts_before;
    {
        let gpu = Gpu::new();
        contexts_before = gpu.standin.counter("contexts_created");
        let s = &gpu.stream;
        let mut dst = s.alloc_zeros::<f32>(1000).unwrap();
        let src = s.alloc_zeros::<f32>(1000).unwrap();
        let (n, value) = (1000u32, 7.0f32);
        // Planted: `if (i > n) return;` lets thread n write dst[n].
        let fill = gpu.kernel("fill_off_by_one");
        let scale = gpu.kernel("scale");
        let mut launch = s.launch_builder(&fill);
        launch.arg(&mut dst).arg(&n).arg(&value);
        // SAFETY: the arguments match the signature; the kernel's own bound is the bug.
        unsafe { launch.launch(blocks(1024, 256)) }.expect("queued: the fault comes when it runs");
        let err = s.synchronize().expect_err("the overrun is caught");
        assert_eq!(code(&err), CUresult::CUDA_ERROR_ILLEGAL_ADDRESS);
        let why = gpu.standin.last_error();
        assert!(
            why.contains("kernel fill_off_by_one")
                && why.contains("illegal write")
                && why.contains("0 bytes past the end of the 4000-byte allocation"),
            "{why}"
        );
        // Sticky, as on a GPU: the context runs nothing more.
        let mut launch = s.launch_builder(&scale);
        launch.arg(&src).arg(&n).arg(&value).arg(&mut dst);
        // SAFETY: a correct launch; the context refuses it.
        let err = unsafe { launch.launch(blocks(1000, 256)) }.expect_err("sticky");
        assert_eq!(code(&err), CUresult::CUDA_ERROR_ILLEGAL_ADDRESS);
        // Everything is dropped here: the last release destroys the context.
    }
    // A new context works: what celer's device recovery relies on.
    let gpu = Gpu::new();
    assert!(gpu.standin.counter("contexts_created") > contexts_before);
    let s = &gpu.stream;
    let mut dst = s.alloc_zeros::<f32>(1000).unwrap();
    let src = s.clone_htod(&vec![1.0f32; 1000]).unwrap();
    let (n, factor) = (1000u32, 3.0f32);
    let scale = gpu.kernel("scale");
    let mut launch = s.launch_builder(&scale);
    launch.arg(&src).arg(&n).arg(&factor).arg(&mut dst);
    // SAFETY: the arguments match scale's signature; the buffers hold n floats.
    unsafe { launch.launch(blocks(1000, 256)) }.unwrap();
    assert!(s.clone_dtoh(&dst).unwrap().iter().all(|&v| v == 3.0));
}

#[test]
fn a_lane_returning_before_a_warp_shuffle_is_caught() {
    let _one = serial();
    let gpu = Gpu::new();
    let s = &gpu.stream;
    let input: Vec<u32> = (1..=40).collect();
    let src = s.clone_htod(&input).unwrap();
    let n = 40u32;

    // The twin: every lane takes part in the shuffles.
    let mut out = s.alloc_zeros::<u32>(2).unwrap();
    let sums = gpu.kernel("warp_sums");
    let mut launch = s.launch_builder(&sums);
    launch.arg(&src).arg(&n).arg(&mut out);
    // SAFETY: the arguments match warp_sums' signature; out holds one sum per warp.
    unsafe { launch.launch(blocks(64, 64)) }.unwrap();
    let got = s.clone_dtoh(&out).unwrap();
    assert_eq!(got, vec![(1..=32).sum::<u32>(), (33..=40).sum::<u32>()]);

    // Planted: lanes 40..63 return before the shuffles that name them.
    let early = gpu.kernel("warp_sums_early_return");
    let mut launch = s.launch_builder(&early);
    launch.arg(&src).arg(&n).arg(&mut out);
    // SAFETY: the arguments match the signature; the early return is the bug.
    unsafe { launch.launch(blocks(64, 64)) }.unwrap();
    let err = s.synchronize().expect_err("the early return is caught");
    assert_eq!(code(&err), CUresult::CUDA_ERROR_LAUNCH_FAILED);
    let why = gpu.standin.last_error();
    assert!(
        why.contains("kernel warp_sums_early_return")
            && why.contains("lane 8 of warp 1")
            && why.contains("returned before __shfl_down_sync(0xffffffff)"),
        "{why}"
    );
}

#[test]
fn shared_memory_and_syncthreads_work_per_block() {
    let _one = serial();
    let gpu = Gpu::new();
    let s = &gpu.stream;
    let input: Vec<u32> = (0..1000).map(|i| i % 97).collect();
    let src = s.clone_htod(&input).unwrap();
    let n = 1000u32;
    let blocks_of_64 = 1000u32.div_ceil(64);
    let mut out = s.alloc_zeros::<u32>(blocks_of_64 as usize).unwrap();
    let sums = gpu.kernel("block_sums");
    let mut launch = s.launch_builder(&sums);
    launch.arg(&src).arg(&n).arg(&mut out);
    // SAFETY: the arguments match block_sums' signature; out holds one sum per block.
    unsafe { launch.launch(blocks(1000, 64)) }.unwrap();
    let got = s.clone_dtoh(&out).unwrap();
    let want: Vec<u32> = input.chunks(64).map(|c| c.iter().sum()).collect();
    assert_eq!(got, want);
}

#[test]
fn timing_needs_events_made_for_it() {
    let _one = serial();
    let gpu = Gpu::new();
    let s = &gpu.stream;
    // cudarc's default event has timing disabled: elapsed time between two is refused,
    // as the real driver refuses it (the bug a review of celer's stage timing found).
    let a = s.record_event(None).unwrap();
    let b = s.record_event(None).unwrap();
    let err = a.elapsed_ms(&b).expect_err("untimed events");
    assert_eq!(code(&err), CUresult::CUDA_ERROR_INVALID_HANDLE);
    let timed = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
    let a = s.record_event(timed).unwrap();
    let mut buffer = s.alloc_zeros::<u8>(1 << 20).unwrap();
    s.memset_zeros(&mut buffer).unwrap();
    let b = s.record_event(timed).unwrap();
    assert!(a.elapsed_ms(&b).expect("timed events") >= 0.0);
}

#[test]
fn injected_faults_fail_a_launch_or_poison_the_context() {
    let _one = serial();
    {
        let gpu = Gpu::new();
        let s = &gpu.stream;
        let src = s.clone_htod(&[1.0f32; 64]).unwrap();
        let mut dst = s.alloc_zeros::<f32>(64).unwrap();
        let scale = gpu.kernel("scale");
        let (n, factor) = (64u32, 2.0f32);
        let launch = |dst: &mut cudarc::driver::CudaSlice<f32>| {
            let mut b = s.launch_builder(&scale);
            b.arg(&src).arg(&n).arg(&factor).arg(dst);
            // SAFETY: the arguments match scale's signature; the buffers hold n floats.
            unsafe { b.launch(blocks(64, 64)) }
        };
        gpu.standin.inject(Fault::LaunchFails, 1);
        let err = launch(&mut dst).expect_err("the injected launch failure");
        assert_eq!(code(&err), CUresult::CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES);
        // Not sticky: the next launch runs.
        launch(&mut dst).expect("the context still works");
        s.synchronize().unwrap();
        gpu.standin.inject(Fault::StickyError, 1);
        launch(&mut dst).expect("queued");
        let err = s.synchronize().expect_err("the injected fault");
        assert_eq!(code(&err), CUresult::CUDA_ERROR_ILLEGAL_ADDRESS);
        let err = s.alloc_zeros::<f32>(1).expect_err("sticky");
        assert_eq!(code(&err), CUresult::CUDA_ERROR_ILLEGAL_ADDRESS);
    }
    // Released and retained again: a new context without the error.
    let gpu = Gpu::new();
    gpu.stream.alloc_zeros::<f32>(1).expect("a fresh context");
}

#[test]
fn counters_count_each_kind_of_call() {
    let _one = serial();
    let gpu = Gpu::new();
    let s = &gpu.stream;
    let before = gpu.standin.counters();
    // One of each: an allocation (zeroed: a memset), an upload, a copy on the device, a
    // launch, a download into pageable memory (a host wait), a stream, event and context
    // synchronisation, a pinned allocation and its free, a device free.
    let mut a = s.alloc_zeros::<f32>(256).unwrap();
    s.memcpy_htod(&[1.0f32; 256], &mut a).unwrap();
    let mut b = s.alloc_zeros::<f32>(256).unwrap();
    s.memcpy_dtod(&a, &mut b).unwrap();
    let scale = gpu.kernel("scale");
    let (n, factor) = (256u32, 2.0f32);
    let mut launch = s.launch_builder(&scale);
    launch.arg(&a).arg(&n).arg(&factor).arg(&mut b);
    // SAFETY: the arguments match scale's signature; the buffers hold n floats.
    unsafe { launch.launch(blocks(256, 64)) }.unwrap();
    let mut host = vec![0.0f32; 256];
    s.memcpy_dtoh(&b, &mut host).unwrap();
    s.synchronize().unwrap();
    s.record_event(None).unwrap().synchronize().unwrap();
    gpu.context.synchronize().unwrap();
    let pinned = celer::cuda::pinned::<u8>(&gpu.context, 4096, false).unwrap();
    drop(pinned);
    drop(a);
    s.synchronize().unwrap();
    let d = gpu.standin.counters() - before;
    assert_eq!(host, vec![2.0f32; 256]);
    assert_eq!(d.device_allocs, 2, "{d:?}");
    assert_eq!(d.device_frees, 1, "{d:?}");
    assert_eq!((d.memsets, d.memset_bytes), (2, 2 * 1024), "{d:?}");
    assert_eq!((d.htod_copies, d.htod_bytes), (1, 1024), "{d:?}");
    assert_eq!((d.dtod_copies, d.dtod_bytes), (1, 1024), "{d:?}");
    assert_eq!((d.dtoh_copies, d.dtoh_bytes), (1, 1024), "{d:?}");
    assert_eq!((d.launches_enqueued, d.launches_run), (1, 1), "{d:?}");
    assert_eq!(
        (d.pinned_allocs, d.pinned_alloc_bytes, d.pinned_frees),
        (1, 4096, 1),
        "{d:?}"
    );
    assert!(
        d.event_syncs >= 1 && d.ctx_syncs >= 1 && d.stream_syncs >= 2,
        "{d:?}"
    );
    assert_eq!(
        d.host_syncs,
        d.stream_syncs + d.event_syncs + d.ctx_syncs + 1,
        "the pageable download waits too: {d:?}"
    );
    assert_eq!(d.sticky_errors, 0, "{d:?}");
    // Every field is a counter the driver knows.
    for name in celer_cuda_standin::Counters::NAMES {
        assert_ne!(gpu.standin.counter(name), u64::MAX, "{name}");
    }
}
