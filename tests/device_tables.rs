//! The resize tables a change of image size needs, made on the device (tables.cu) from
//! their sizes, are bit-identical to the host's (src/cuda/taps.rs): PIL's fixed-point
//! taps, PIL's bilinear weights in f32, fast_image_resize's convolution coefficients in
//! f32 and PIL NEAREST's indices, over many (source, target) pairs: shrinking and
//! enlarging, 1-sample edges, odd ratios and the largest side the decoder accepts. Each
//! table is made into buffers that held another size's table first, as a replica's do.

mod gpu_support;

use std::sync::Arc;

use celer::codec::decode::MAX_SIDE_PX;
use celer::cuda::driver::{CudaSlice, CudaStream, DeviceRepr};
use celer::cuda::launch::{taps_capacity, GpuNearest, GpuTaps, Launcher};
use celer::cuda::taps::{nearest_indices, ConvolutionTaps, FixedTaps, FlatTaps, UpsampleTaps};

/// Sizes on either side of a table: edges, primes, the model sizes, photo sides, the
/// largest side.
const SIDES: [u32; 14] = [
    1,
    2,
    3,
    7,
    17,
    320,
    333,
    756,
    1008,
    1080,
    1920,
    3024,
    4032,
    MAX_SIDE_PX,
];

fn down<T: DeviceRepr + Default + Clone>(
    s: &Arc<CudaStream>,
    buf: &CudaSlice<T>,
    n: usize,
) -> Vec<T> {
    let v = s.clone_dtoh(buf).unwrap();
    s.synchronize().unwrap();
    v[..n].to_vec()
}

/// Every pair of `SIDES` (the largest side only to and from a few others, to keep the
/// run short on the stand-in).
fn pairs() -> Vec<(u32, u32)> {
    let mut out = Vec::new();
    for &i in &SIDES {
        for &o in &SIDES {
            let big = i == MAX_SIDE_PX || o == MAX_SIDE_PX;
            if !big || [1, 17, 320, 4032, MAX_SIDE_PX].contains(&i.min(o)) {
                out.push((i, o));
            }
        }
    }
    out
}

/// `gpu`'s table (first, count, weights over `stride` a sample) against `host`'s, bit
/// for bit (weights compared as bits: -0.0 and 0.0 differ).
fn assert_same<W, B>(
    what: &str,
    (i, o): (u32, u32),
    s: &Arc<CudaStream>,
    gpu: &GpuTaps<W>,
    host: &FlatTaps<W>,
    bits: fn(W) -> B,
) where
    W: DeviceRepr + Default + Clone + Copy + PartialEq + std::fmt::Debug,
    B: PartialEq + std::fmt::Debug,
{
    let n = o as usize;
    assert_eq!(gpu.stride, host.stride, "{what} {i}->{o}: stride");
    assert_eq!(gpu.span, host.span(), "{what} {i}->{o}: span");
    assert_eq!(down(s, &gpu.first, n), host.first, "{what} {i}->{o}: first");
    assert_eq!(down(s, &gpu.count, n), host.count, "{what} {i}->{o}: count");
    let weights = down(s, &gpu.weights, n * host.stride as usize);
    let mismatch = weights
        .iter()
        .zip(&host.weights)
        .position(|(g, h)| bits(*g) != bits(*h));
    assert_eq!(
        mismatch.map(|k| (k, weights[k], host.weights[k])),
        None,
        "{what} {i}->{o}: the first weight that differs (index, device, host)"
    );
    assert_eq!(
        weights.len(),
        host.weights.len(),
        "{what} {i}->{o}: weights"
    );
}

/// The launch counter is the process's: one test launches at a time.
fn alone() -> std::sync::MutexGuard<'static, ()> {
    static ALONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    ALONE.lock().unwrap_or_else(|p| p.into_inner())
}

#[test]
fn tables_made_on_the_device_are_the_hosts_bit_for_bit() {
    let _alone = alone();
    let dev = gpu_support::gpu();
    let s = dev.new_stream().unwrap();
    let l = Launcher {
        stream: &s,
        kernels: dev.kernels(),
    };
    let (outs, weights) = taps_capacity(MAX_SIDE_PX, MAX_SIDE_PX);
    let mut fixed = GpuTaps::<i32>::alloc(&s, outs, weights).unwrap();
    let mut upsample = GpuTaps::<f32>::alloc(&s, outs, weights).unwrap();
    let mut convolution = GpuTaps::<f32>::alloc(&s, outs, weights).unwrap();
    let mut nearest = GpuNearest::alloc(&s, MAX_SIDE_PX, MAX_SIDE_PX).unwrap();
    let pairs = pairs();
    for &(i, o) in &pairs {
        fixed.set_fixed(&l, i, o).unwrap();
        assert_same(
            "PIL fixed",
            (i, o),
            &s,
            &fixed,
            &FixedTaps::bilinear(i, o),
            |w| w,
        );
        upsample.set_upsample(&l, i, o).unwrap();
        assert_same(
            "PIL f32",
            (i, o),
            &s,
            &upsample,
            &UpsampleTaps::bilinear(i, o),
            f32::to_bits,
        );
        convolution.set_convolution(&l, i, o).unwrap();
        let host = ConvolutionTaps::bilinear(i, o).to_f32();
        assert_same("convolution", (i, o), &s, &convolution, &host, f32::to_bits);
    }
    // NEAREST: both axes at once, each pair as columns with its reverse as rows.
    for &(i, o) in &pairs {
        nearest.set(&l, (i, o), (o, i)).unwrap();
        assert_eq!(
            down(&s, &nearest.xs, o as usize),
            nearest_indices(i, o),
            "NEAREST {i}->{o}"
        );
        assert_eq!(
            down(&s, &nearest.ys, i as usize),
            nearest_indices(o, i),
            "NEAREST {o}->{i}"
        );
    }
}

/// A table already there for its sizes is not made again: no launch.
#[test]
fn a_table_for_the_same_sizes_launches_nothing() {
    let _alone = alone();
    let dev = gpu_support::gpu();
    let standin = gpu_support::driver()
        .standin()
        .expect("the launch count is the stand-in CUDA driver's: run on it");
    let s = dev.new_stream().unwrap();
    let l = Launcher {
        stream: &s,
        kernels: dev.kernels(),
    };
    let (outs, weights) = taps_capacity(4032, 320);
    let mut fixed = GpuTaps::<i32>::alloc(&s, outs, weights).unwrap();
    fixed.set_fixed(&l, 4032, 320).unwrap();
    let before = standin.counter("launches_enqueued");
    fixed.set_fixed(&l, 4032, 320).unwrap();
    assert_eq!(
        standin.counter("launches_enqueued"),
        before,
        "the same sizes"
    );
    fixed.set_fixed(&l, 3024, 320).unwrap();
    assert_eq!(
        standin.counter("launches_enqueued"),
        before + 1,
        "another size"
    );
}
