//! Typed launchers: one method per kernel, taking device buffers and sizes, never raw
//! pointers. Each checks that every buffer holds what the kernel will touch before
//! launching, so a wrong size is an error here and never an out-of-bounds access on the
//! device. All launches are asynchronous on the launcher's stream.

use std::sync::Arc;

use super::driver::{
    CudaSlice, CudaStream, DeviceRepr, LaunchConfig, PushKernelArg, ValidAsZeroBits,
};
use half::f16;

use super::device::KernelSet;
use super::taps::{ConvolutionTaps, FixedTaps, FlatTaps, UpsampleTaps};
use super::CudaError;
use crate::spec::{Normalize, Scale};

/// Threads per block of the element-wise kernels.
const BLOCK: u32 = 256;
/// Threads per block of the guided filter's row passes: one warp, which owns a tile of
/// rows (guided_filter.cu, `RowTiles`).
const ROW_PASS_BLOCK: u32 = 32;
/// Rows per block of `box_rows_guide` (4 sums a row) and `box_rows_coefficients` (2):
/// `ROW_PASS_BLOCK / sums`, as `RowTiles::ROWS` in guided_filter.cu.
const GUIDE_ROWS_PER_BLOCK: u32 = ROW_PASS_BLOCK / 4;
const COEFFICIENT_ROWS_PER_BLOCK: u32 = ROW_PASS_BLOCK / 2;
/// Threads per block of the guided filter's column passes (one thread per column, 1008
/// columns at the served 1/4 of 4032): one warp, so that the few warps there are land on
/// as many SMs as there are blocks. A warp still reads 32 consecutive columns.
const COLUMN_PASS_BLOCK: u32 = 32;

/// One launch of the guided filter's fit: kernel, threads in all, threads per block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FitLaunch {
    pub kernel: &'static str,
    pub threads: u64,
    pub block: u32,
}

impl FitLaunch {
    pub fn blocks(&self) -> u64 {
        self.threads.div_ceil(u64::from(self.block))
    }
}

/// The four launches of `guided_coefficients` for a `w` x `h` fit, in order: the row
/// passes run one-warp blocks of 8 rows x 4 sums and 16 rows x 2 sums, the column passes
/// one thread per column in one-warp blocks.
pub fn guided_fit_launches((w, h): (u32, u32)) -> [FitLaunch; 4] {
    let rows = |per_block: u32| u64::from(h.div_ceil(per_block)) * u64::from(ROW_PASS_BLOCK);
    [
        FitLaunch {
            kernel: "box_rows_guide",
            threads: rows(GUIDE_ROWS_PER_BLOCK),
            block: ROW_PASS_BLOCK,
        },
        FitLaunch {
            kernel: "box_columns_coefficients",
            threads: u64::from(w),
            block: COLUMN_PASS_BLOCK,
        },
        FitLaunch {
            kernel: "box_rows_coefficients",
            threads: rows(COEFFICIENT_ROWS_PER_BLOCK),
            block: ROW_PASS_BLOCK,
        },
        FitLaunch {
            kernel: "box_columns_means",
            threads: u64::from(w),
            block: COLUMN_PASS_BLOCK,
        },
    ]
}

/// A 1-D launch covering `threads` threads; `None` when there is nothing to do.
fn config(threads: u64, block: u32) -> Result<Option<LaunchConfig>, CudaError> {
    if threads == 0 {
        return Ok(None);
    }
    let blocks = threads.div_ceil(u64::from(block));
    let blocks = u32::try_from(blocks).map_err(|_| CudaError::Stage {
        stage: "launch",
        reason: format!("{threads} threads exceed one 1-D grid"),
    })?;
    Ok(Some(LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    }))
}

fn need<T>(what: &'static str, buffer: &CudaSlice<T>, needed: u64) -> Result<(), CudaError> {
    let needed = usize::try_from(needed).unwrap_or(usize::MAX);
    if buffer.len() < needed {
        return Err(CudaError::BufferTooSmall {
            what,
            needed,
            capacity: buffer.len(),
        });
    }
    Ok(())
}

fn as_u32(what: &'static str, v: u64) -> Result<u32, CudaError> {
    u32::try_from(v).map_err(|_| CudaError::Stage {
        stage: what,
        reason: format!("{v} does not fit the kernels' 32-bit sizes"),
    })
}

/// A separable resize as its taps were uploaded: the target size, and the source rows
/// `row0..row0 + rows` that the horizontal pass covers.
struct Separable {
    dst: (u32, u32),
    row0: u32,
    rows: u32,
}

impl Separable {
    /// The resize the taps describe for a `src`-sized source; an error naming `stage`
    /// when none were uploaded, or when they were for another source size.
    fn of<W: DeviceRepr>(
        stage: &'static str,
        src: (u32, u32),
        horizontal: &GpuTaps<W>,
        vertical: &GpuTaps<W>,
    ) -> Result<Self, CudaError> {
        let (Some((hin, dst_w)), Some((vin, dst_h))) = (horizontal.sizes, vertical.sizes) else {
            return Err(CudaError::Stage {
                stage,
                reason: "no taps uploaded".into(),
            });
        };
        if (hin, vin) != src {
            return Err(CudaError::Stage {
                stage,
                reason: format!("taps for {hin}x{vin}, source is {}x{}", src.0, src.1),
            });
        }
        let (row0, row_end) = vertical.span;
        Ok(Self {
            dst: (dst_w, dst_h),
            row0,
            rows: row_end - row0,
        })
    }

    /// Threads of the horizontal pass: one per output column of each covered row.
    fn horizontal_threads(&self) -> u64 {
        u64::from(self.dst.0) * u64::from(self.rows)
    }

    fn pixels(&self) -> u64 {
        u64::from(self.dst.0) * u64::from(self.dst.1)
    }
}

/// Launches kernel `$name` over `$threads` threads with the arguments in order. The
/// argument list must match the kernel's C signature, type for type.
macro_rules! launch {
    ($self:expr, $name:literal, $threads:expr, $block:expr; $($arg:expr),* $(,)?) => {{
        let function = $self.kernels.get($name)?;
        if let Some(cfg) = config($threads, $block)? {
            let mut builder = $self.stream.launch_builder(function);
            $( builder.arg($arg); )*
            // SAFETY: the arguments match the kernel's signature in kernels/*.cu (same
            // order, same types: device buffers for pointers, u32/i32/f32 for scalars),
            // and the caller checked that every buffer holds all the elements the
            // kernel touches for these sizes.
            unsafe { builder.launch(cfg) }.map_err(CudaError::from)?;
        }
        Ok::<(), CudaError>(())
    }};
}

/// Taps of one axis on the device, sized at start-up for the largest table accepted.
pub struct GpuTaps<W: DeviceRepr> {
    pub first: CudaSlice<u32>,
    pub count: CudaSlice<u32>,
    pub weights: CudaSlice<W>,
    pub stride: u32,
    /// Source samples read: `span.0..span.1`.
    pub span: (u32, u32),
    /// The (source, target) sizes of the uploaded table, to skip re-uploads.
    pub sizes: Option<(u32, u32)>,
}

/// Capacity of a table mapping at most `in_max` to at most `out_max` samples: enough for
/// either kind (a window of 2*ceil(in/out) + 3 per output at most).
pub fn taps_capacity(in_max: u32, out_max: u32) -> (usize, usize) {
    let weights = 2 * in_max as usize + 4 * out_max as usize + 16;
    (out_max as usize, weights)
}

impl<W: DeviceRepr + ValidAsZeroBits> GpuTaps<W> {
    pub fn alloc(
        stream: &Arc<CudaStream>,
        outputs: usize,
        weights: usize,
    ) -> Result<Self, CudaError> {
        Ok(Self {
            first: stream.alloc_zeros(outputs.max(1))?,
            count: stream.alloc_zeros(outputs.max(1))?,
            weights: stream.alloc_zeros(weights.max(1))?,
            stride: 0,
            span: (0, 0),
            sizes: None,
        })
    }

    fn upload(
        &mut self,
        stream: &Arc<CudaStream>,
        first: &[u32],
        count: &[u32],
        weights: &[W],
        stride: u32,
        span: (u32, u32),
    ) -> Result<(), CudaError> {
        need("taps", &self.first, first.len() as u64)?;
        need("tap weights", &self.weights, weights.len() as u64)?;
        stream.memcpy_htod(first, &mut self.first)?;
        stream.memcpy_htod(count, &mut self.count)?;
        stream.memcpy_htod(weights, &mut self.weights)?;
        self.stride = stride;
        self.span = span;
        Ok(())
    }
}

impl<W: DeviceRepr + ValidAsZeroBits + Copy + Default> GpuTaps<W> {
    /// Uploads `make(in_size, out_size)` unless these sizes are already there.
    fn set_with(
        &mut self,
        stream: &Arc<CudaStream>,
        in_size: u32,
        out_size: u32,
        make: fn(u32, u32) -> FlatTaps<W>,
    ) -> Result<(), CudaError> {
        if self.sizes == Some((in_size, out_size)) {
            return Ok(());
        }
        let taps = make(in_size, out_size);
        self.upload(
            stream,
            &taps.first,
            &taps.count,
            &taps.weights,
            taps.stride,
            taps.span(),
        )?;
        self.sizes = Some((in_size, out_size));
        Ok(())
    }
}

impl GpuTaps<i32> {
    /// Uploads PIL's fixed-point taps for `in_size` -> `out_size` unless already there.
    pub fn set_fixed(
        &mut self,
        stream: &Arc<CudaStream>,
        in_size: u32,
        out_size: u32,
    ) -> Result<(), CudaError> {
        self.set_with(stream, in_size, out_size, FixedTaps::bilinear)
    }
}

impl GpuTaps<f32> {
    /// Uploads fast_image_resize's coefficients for `in_size` -> `out_size`, rounded to
    /// the f32 the plane resize computes in, unless already there. A `GpuTaps<f32>`
    /// holds one kind of table for its life: these, or `set_upsample`'s.
    pub fn set_convolution(
        &mut self,
        stream: &Arc<CudaStream>,
        in_size: u32,
        out_size: u32,
    ) -> Result<(), CudaError> {
        self.set_with(stream, in_size, out_size, |i, o| {
            ConvolutionTaps::bilinear(i, o).to_f32()
        })
    }

    /// Uploads the guided filter's upsampling taps (PIL's bilinear weights in f32) for
    /// `in_size` -> `out_size` unless already there.
    pub fn set_upsample(
        &mut self,
        stream: &Arc<CudaStream>,
        in_size: u32,
        out_size: u32,
    ) -> Result<(), CudaError> {
        self.set_with(stream, in_size, out_size, UpsampleTaps::bilinear)
    }
}

/// PIL NEAREST's indices for both axes on the device.
pub struct GpuNearest {
    pub xs: CudaSlice<u32>,
    pub ys: CudaSlice<u32>,
    pub sizes: Option<((u32, u32), (u32, u32))>,
}

impl GpuNearest {
    pub fn alloc(stream: &Arc<CudaStream>, max_w: u32, max_h: u32) -> Result<Self, CudaError> {
        Ok(Self {
            xs: stream.alloc_zeros(max_w.max(1) as usize)?,
            ys: stream.alloc_zeros(max_h.max(1) as usize)?,
            sizes: None,
        })
    }

    /// Uploads the indices for `src` -> `dst` unless already there.
    pub fn set(
        &mut self,
        stream: &Arc<CudaStream>,
        src: (u32, u32),
        dst: (u32, u32),
    ) -> Result<(), CudaError> {
        if self.sizes == Some((src, dst)) {
            return Ok(());
        }
        let xs = super::taps::nearest_indices(src.0, dst.0);
        let ys = super::taps::nearest_indices(src.1, dst.1);
        need("nearest columns", &self.xs, xs.len() as u64)?;
        need("nearest rows", &self.ys, ys.len() as u64)?;
        stream.memcpy_htod(&xs, &mut self.xs)?;
        stream.memcpy_htod(&ys, &mut self.ys)?;
        self.sizes = Some((src, dst));
        Ok(())
    }
}

/// Where the normalised planar input goes.
pub enum ModelInput<'a> {
    F32(&'a mut CudaSlice<f32>),
    F16(&'a mut CudaSlice<f16>),
}

impl ModelInput<'_> {
    fn len(&self) -> usize {
        match self {
            ModelInput::F32(b) => b.len(),
            ModelInput::F16(b) => b.len(),
        }
    }
}

/// The kernels, bound to one replica's stream.
pub struct Launcher<'a> {
    pub stream: &'a Arc<CudaStream>,
    pub kernels: &'a KernelSet,
}

impl Launcher<'_> {
    /// PIL bilinear resize of interleaved RGB8 `src` (`src_w` x `src_h`) to `dst_w` x
    /// `dst_h`, normalised into planar `out`. `tmp` holds the horizontal pass; with the
    /// "max" scale `resized` and `max_value` hold the resized image and its max.
    #[allow(clippy::too_many_arguments)]
    pub fn preprocess(
        &self,
        src: &CudaSlice<u8>,
        (src_w, src_h): (u32, u32),
        horizontal: &GpuTaps<i32>,
        vertical: &GpuTaps<i32>,
        (dst_w, dst_h): (u32, u32),
        norm: &Normalize,
        tmp: &mut CudaSlice<u8>,
        resized: &mut CudaSlice<u8>,
        max_value: &mut CudaSlice<u32>,
        out: ModelInput<'_>,
    ) -> Result<(), CudaError> {
        let resize = Separable::of("preprocess", (src_w, src_h), horizontal, vertical)?;
        if resize.dst != (dst_w, dst_h) {
            return Err(CudaError::Stage {
                stage: "preprocess",
                reason: "taps uploaded for other sizes".into(),
            });
        }
        let Separable { row0, rows, .. } = resize;
        let pixels = resize.pixels();
        need("source image", src, u64::from(src_w) * u64::from(src_h) * 3)?;
        need("horizontal pass", tmp, resize.horizontal_threads() * 3)?;
        if (out.len() as u64) < pixels * 3 {
            return Err(CudaError::BufferTooSmall {
                what: "model input",
                needed: (pixels * 3) as usize,
                capacity: out.len(),
            });
        }
        let [m0, m1, m2] = norm.mean;
        let [s0, s1, s2] = norm.std;
        match norm.scale {
            // The horizontal pass, then the vertical pass fused with the normalisation.
            Scale::Fixed(scale) => {
                launch!(self, "resize_rgb8_horizontal", resize.horizontal_threads(), BLOCK;
                    src, &src_w, &row0, &rows, &horizontal.first, &horizontal.count,
                    &horizontal.weights, &horizontal.stride, &mut *tmp, &dst_w)?;
                match out {
                    ModelInput::F32(out) => {
                        launch!(self, "resize_rgb8_vertical_normalize_f32", pixels, BLOCK;
                            &*tmp, &dst_w, &dst_h, &row0, &vertical.first, &vertical.count,
                            &vertical.weights, &vertical.stride, &scale,
                            &m0, &m1, &m2, &s0, &s1, &s2, out)
                    }
                    ModelInput::F16(out) => {
                        launch!(self, "resize_rgb8_vertical_normalize_f16", pixels, BLOCK;
                            &*tmp, &dst_w, &dst_h, &row0, &vertical.first, &vertical.count,
                            &vertical.weights, &vertical.stride, &scale,
                            &m0, &m1, &m2, &s0, &s1, &s2, out)
                    }
                }
            }
            // The normalisation needs the resized image's max first: the plain resize
            // (which computes it), then a normalising pass.
            Scale::ImageMax => {
                self.resize_rgb8(
                    src,
                    (src_w, src_h),
                    horizontal,
                    vertical,
                    tmp,
                    resized,
                    max_value,
                )?;
                let pixels32 = as_u32("preprocess", pixels)?;
                let scale_is_max: i32 = 1;
                let unused_scale = 1.0f32;
                match out {
                    ModelInput::F32(out) => launch!(self, "normalize_rgb8_f32", pixels, BLOCK;
                        &*resized, &pixels32, &*max_value, &scale_is_max, &unused_scale,
                        &m0, &m1, &m2, &s0, &s1, &s2, out),
                    ModelInput::F16(out) => launch!(self, "normalize_rgb8_f16", pixels, BLOCK;
                        &*resized, &pixels32, &*max_value, &scale_is_max, &unused_scale,
                        &m0, &m1, &m2, &s0, &s1, &s2, out),
                }
            }
        }
    }

    /// PIL bilinear resize of interleaved RGB8 `src` to interleaved RGB8 `out` (the
    /// taps' target size), as `preprocess::resize_rgb`; `tmp` holds the horizontal pass.
    /// `max_value` receives the image's max, which the "max" scale divides by.
    #[allow(clippy::too_many_arguments)]
    pub fn resize_rgb8(
        &self,
        src: &CudaSlice<u8>,
        (src_w, src_h): (u32, u32),
        horizontal: &GpuTaps<i32>,
        vertical: &GpuTaps<i32>,
        tmp: &mut CudaSlice<u8>,
        out: &mut CudaSlice<u8>,
        max_value: &mut CudaSlice<u32>,
    ) -> Result<(), CudaError> {
        let resize = Separable::of("resize rgb", (src_w, src_h), horizontal, vertical)?;
        let Separable {
            dst: (dst_w, dst_h),
            row0,
            ..
        } = resize;
        let pixels = resize.pixels();
        need("resized image", out, pixels * 3)?;
        need("max", max_value, 1)?;
        self.resize_rgb8_rows(src, (src_w, src_h), &resize, horizontal, tmp)?;
        self.stream.memset_zeros(max_value)?;
        launch!(self, "resize_rgb8_vertical", pixels, BLOCK;
            &*tmp, &dst_w, &dst_h, &row0, &vertical.first, &vertical.count,
            &vertical.weights, &vertical.stride, out, max_value)
    }

    /// The luma (`luma_rgb8`'s) of `src` resized as [`Launcher::resize_rgb8`] resizes
    /// it, into `luma` (the taps' target size): the guided filter's guide. The resized
    /// image is never stored, nor its max computed.
    pub fn resize_rgb8_luma(
        &self,
        src: &CudaSlice<u8>,
        (src_w, src_h): (u32, u32),
        horizontal: &GpuTaps<i32>,
        vertical: &GpuTaps<i32>,
        tmp: &mut CudaSlice<u8>,
        luma: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        let resize = Separable::of("resize rgb", (src_w, src_h), horizontal, vertical)?;
        let Separable {
            dst: (dst_w, dst_h),
            row0,
            ..
        } = resize;
        need("luma", luma, resize.pixels())?;
        self.resize_rgb8_rows(src, (src_w, src_h), &resize, horizontal, tmp)?;
        launch!(self, "resize_rgb8_vertical_luma", resize.pixels(), BLOCK;
            &*tmp, &dst_w, &dst_h, &row0, &vertical.first, &vertical.count,
            &vertical.weights, &vertical.stride, luma)
    }

    /// The horizontal pass both RGB8 resizes share: the rows the vertical pass reads,
    /// resized across, into `tmp`.
    fn resize_rgb8_rows(
        &self,
        src: &CudaSlice<u8>,
        (src_w, src_h): (u32, u32),
        resize: &Separable,
        horizontal: &GpuTaps<i32>,
        tmp: &mut CudaSlice<u8>,
    ) -> Result<(), CudaError> {
        let &Separable {
            dst: (dst_w, _),
            row0,
            rows,
        } = resize;
        need("source image", src, u64::from(src_w) * u64::from(src_h) * 3)?;
        need("horizontal pass", tmp, resize.horizontal_threads() * 3)?;
        launch!(self, "resize_rgb8_horizontal", resize.horizontal_threads(), BLOCK;
            src, &src_w, &row0, &rows, &horizontal.first, &horizontal.count,
            &horizontal.weights, &horizontal.stride, &mut *tmp, &dst_w)
    }

    /// Channel 0 of a probability output (`w` x `h`) -> clamped (optionally min-max
    /// rescaled) `coarse` and the thresholded `trimap`.
    #[allow(clippy::too_many_arguments)]
    pub fn probability_trimap(
        &self,
        mask: &CudaSlice<f32>,
        (w, h): (u32, u32),
        minmax: bool,
        foreground: f32,
        background: f32,
        lohi: &mut CudaSlice<u32>,
        coarse: &mut CudaSlice<f32>,
        trimap: &mut CudaSlice<u8>,
    ) -> Result<(), CudaError> {
        let n = u64::from(w) * u64::from(h);
        need("mask", mask, n)?;
        need("coarse mask", coarse, n)?;
        need("trimap", trimap, n)?;
        need("min/max", lohi, 2)?;
        let n32 = as_u32("trimap", n)?;
        if minmax {
            launch!(self, "mask_minmax_init", 1, 32; &mut *lohi)?;
            launch!(self, "mask_minmax", n, BLOCK; mask, &n32, &mut *lohi)?;
        }
        let minmax_flag = i32::from(minmax);
        launch!(self, "probability_trimap", n, BLOCK;
            mask, &n32, &*lohi, &minmax_flag, &foreground, &background, coarse, trimap)
    }

    /// Argmax over `classes` score planes (`w` x `h` each) -> `trimap` (mapped through
    /// `class_values`) and `coarse` = trimap / 255.
    #[allow(clippy::too_many_arguments)]
    pub fn classes_trimap(
        &self,
        scores: &CudaSlice<f32>,
        (w, h): (u32, u32),
        classes: u32,
        class_values: &CudaSlice<u8>,
        coarse: &mut CudaSlice<f32>,
        trimap: &mut CudaSlice<u8>,
    ) -> Result<(), CudaError> {
        let n = u64::from(w) * u64::from(h);
        need("class scores", scores, n * u64::from(classes))?;
        need("class values", class_values, u64::from(classes))?;
        need("coarse mask", coarse, n)?;
        need("trimap", trimap, n)?;
        if classes == 0 {
            return Err(CudaError::Stage {
                stage: "trimap",
                reason: "an output with no classes".into(),
            });
        }
        let n32 = as_u32("trimap", n)?;
        launch!(self, "classes_trimap", n, BLOCK; scores, &n32, &classes, class_values, coarse, trimap)
    }

    /// Erodes both certain regions of `trimap` (`w` x `h`) by `radius`.
    pub fn erode(
        &self,
        trimap: &mut CudaSlice<u8>,
        (w, h): (u32, u32),
        radius: u32,
        flags: &mut CudaSlice<u8>,
    ) -> Result<(), CudaError> {
        if radius == 0 {
            return Ok(());
        }
        let n = u64::from(w) * u64::from(h);
        need("trimap", trimap, n)?;
        need("erosion flags", flags, n)?;
        launch!(self, "erode_rows", n, BLOCK; &*trimap, &w, &h, &radius, &mut *flags)?;
        launch!(self, "erode_columns", n, BLOCK; trimap, &*flags, &w, &h, &radius)
    }

    /// PIL NEAREST resize of a u8 plane with the uploaded indices.
    pub fn resize_nearest(
        &self,
        src: &CudaSlice<u8>,
        indices: &GpuNearest,
        dst: &mut CudaSlice<u8>,
    ) -> Result<(), CudaError> {
        let Some(((sw, sh), (dw, dh))) = indices.sizes else {
            return Err(CudaError::Stage {
                stage: "resize nearest",
                reason: "no indices uploaded".into(),
            });
        };
        need("nearest source", src, u64::from(sw) * u64::from(sh))?;
        need("nearest target", dst, u64::from(dw) * u64::from(dh))?;
        launch!(self, "resize_nearest_u8", u64::from(dw) * u64::from(dh), BLOCK;
            src, &sw, &indices.xs, &indices.ys, &dw, &dh, dst)
    }

    /// A trimap as a matting model input: value / 255.
    pub fn trimap_to_unit(
        &self,
        trimap: &CudaSlice<u8>,
        n: u32,
        out: ModelInput<'_>,
    ) -> Result<(), CudaError> {
        need("trimap", trimap, u64::from(n))?;
        if (out.len() as u64) < u64::from(n) {
            return Err(CudaError::BufferTooSmall {
                what: "trimap input",
                needed: n as usize,
                capacity: out.len(),
            });
        }
        match out {
            ModelInput::F32(out) => {
                launch!(self, "trimap_to_unit_f32", u64::from(n), BLOCK; trimap, &n, out)
            }
            ModelInput::F16(out) => {
                launch!(self, "trimap_to_unit_f16", u64::from(n), BLOCK; trimap, &n, out)
            }
        }
    }

    /// `n` float16 values (as bits) to f32, exactly.
    pub fn f16_to_f32(
        &self,
        src: &CudaSlice<f16>,
        n: usize,
        dst: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        need("float16 source", src, n as u64)?;
        need("float32 destination", dst, n as u64)?;
        let count = u32::try_from(n).map_err(|_| CudaError::BufferTooSmall {
            what: "float16 conversion (over u32::MAX elements)",
            needed: n,
            capacity: u32::MAX as usize,
        })?;
        launch!(self, "f16_to_f32", n as u64, BLOCK; src, &count, dst)
    }

    /// fast_image_resize's bilinear resize of an f32 plane (`src_w` x `src_h`) to the
    /// taps' target size (`set_convolution`'s), via `tmp` (the horizontal pass).
    pub fn resize_plane(
        &self,
        src: &CudaSlice<f32>,
        (src_w, src_h): (u32, u32),
        horizontal: &GpuTaps<f32>,
        vertical: &GpuTaps<f32>,
        tmp: &mut CudaSlice<f32>,
        dst: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        let resize = Separable::of("resize plane", (src_w, src_h), horizontal, vertical)?;
        let Separable {
            dst: (dst_w, dst_h),
            row0,
            rows,
        } = resize;
        need("plane source", src, u64::from(src_w) * u64::from(src_h))?;
        need("plane horizontal pass", tmp, resize.horizontal_threads())?;
        need("plane target", dst, u64::from(dst_w) * u64::from(dst_h))?;
        launch!(self, "resize_plane_horizontal", resize.horizontal_threads(), BLOCK;
            src, &src_w, &row0, &rows, &horizontal.first, &horizontal.count,
            &horizontal.weights, &horizontal.stride, &mut *tmp, &dst_w)?;
        launch!(self, "resize_plane_vertical", u64::from(dst_w) * u64::from(dst_h), BLOCK;
            &*tmp, &dst_w, &row0, &vertical.first, &vertical.count, &vertical.weights,
            &vertical.stride, dst, &dst_h)
    }

    /// Luma of interleaved RGB8 (`n` pixels) into `out`.
    pub fn luma(
        &self,
        rgb: &CudaSlice<u8>,
        n: u32,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        need("rgb", rgb, u64::from(n) * 3)?;
        need("luma", out, u64::from(n))?;
        launch!(self, "luma_rgb8", u64::from(n), BLOCK; rgb, &n, out)
    }

    /// The guided filter's fit (`guided_filter::coefficients`) of mask `p` (read clamped
    /// to [0, 1]) with guide `guide`, both `w` x `h`: `mean_a` and `mean_b`, via four
    /// scratch planes.
    #[allow(clippy::too_many_arguments)]
    pub fn guided_coefficients(
        &self,
        guide: &CudaSlice<f32>,
        p: &CudaSlice<f32>,
        (w, h): (u32, u32),
        radius: u32,
        epsilon: f32,
        scratch: &mut [CudaSlice<f32>; 4],
        mean_a: &mut CudaSlice<f32>,
        mean_b: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        let n = u64::from(w) * u64::from(h);
        if n == 0 {
            return Ok(());
        }
        need("guide", guide, n)?;
        need("mask", p, n)?;
        need("mean_a", mean_a, n)?;
        need("mean_b", mean_b, n)?;
        for s in scratch.iter() {
            need("guided filter scratch", s, n)?;
        }
        let [s_i, s_p, s_ip, s_ii] = scratch;
        let [rows_guide, columns_coefficients, rows_coefficients, columns_means] =
            guided_fit_launches((w, h));
        launch!(self, "box_rows_guide", rows_guide.threads, rows_guide.block;
            guide, p, &w, &h, &radius, &mut *s_i, &mut *s_p, &mut *s_ip, &mut *s_ii)?;
        // a and b go where mean_a and mean_b will be: their row sums free them in time.
        launch!(self, "box_columns_coefficients", columns_coefficients.threads,
            columns_coefficients.block;
            &*s_i, &*s_p, &*s_ip, &*s_ii, &w, &h, &radius, &epsilon, &mut *mean_a, &mut *mean_b)?;
        // The first two row-sum planes are free again: reuse them for the sums of a and b.
        launch!(self, "box_rows_coefficients", rows_coefficients.threads, rows_coefficients.block;
            &*mean_a, &*mean_b, &w, &h, &radius, &mut *s_i, &mut *s_p)?;
        launch!(self, "box_columns_means", columns_means.threads, columns_means.block;
            &*s_i, &*s_p, &w, &h, &radius, mean_a, mean_b)
    }

    /// The guided filter's alpha at the source size (`LinearModel::alpha`): 255 / 0
    /// where `trimap` is certain, elsewhere `mean_a` / `mean_b` (`low` size) upsampled
    /// with the uploaded taps and applied to the luma of `rgb`. With `cutout`, also the
    /// RGBA cut-out.
    #[allow(clippy::too_many_arguments)]
    pub fn guided_alpha(
        &self,
        mean_a: &CudaSlice<f32>,
        mean_b: &CudaSlice<f32>,
        (lw, lh): (u32, u32),
        xs: &GpuTaps<f32>,
        ys: &GpuTaps<f32>,
        rgb: &CudaSlice<u8>,
        trimap: &CudaSlice<u8>,
        (w, h): (u32, u32),
        alpha: &mut CudaSlice<u8>,
        cutout: Option<&mut CudaSlice<u8>>,
    ) -> Result<(), CudaError> {
        if xs.sizes != Some((lw, w)) || ys.sizes != Some((lh, h)) {
            return Err(CudaError::Stage {
                stage: "guided alpha",
                reason: format!(
                    "upsampling taps for {:?} x {:?}, need {lw} -> {w} x {lh} -> {h}",
                    xs.sizes, ys.sizes
                ),
            });
        }
        let low = u64::from(lw) * u64::from(lh);
        let n = u64::from(w) * u64::from(h);
        need("mean_a", mean_a, low)?;
        need("mean_b", mean_b, low)?;
        need("rgb", rgb, n * 3)?;
        need("trimap", trimap, n)?;
        need("alpha", alpha, n)?;
        match cutout {
            None => launch!(self, "guided_alpha", n, BLOCK;
                mean_a, mean_b, &lw,
                &xs.first, &xs.count, &xs.weights, &xs.stride,
                &ys.first, &ys.count, &ys.weights, &ys.stride,
                rgb, trimap, &w, &h, alpha),
            Some(rgba) => {
                // Bytes here, a u32 a pixel in the kernel: a CudaSlice starts its
                // allocation, so it is aligned for the 32-bit stores.
                need("rgba", rgba, n * 4)?;
                launch!(self, "guided_alpha_cutout", n, BLOCK;
                    mean_a, mean_b, &lw,
                    &xs.first, &xs.count, &xs.weights, &xs.stride,
                    &ys.first, &ys.count, &ys.weights, &ys.stride,
                    rgb, trimap, &w, &h, alpha, rgba)
            }
        }
    }

    /// Alpha in u8 from `refined` (`n` values), the trimap's certain pixels overriding
    /// it when `use_trimap` (otherwise `trimap` is never read); with `cutout`, also the
    /// RGBA cut-out of `rgb`.
    #[allow(clippy::too_many_arguments)]
    pub fn composite(
        &self,
        refined: &CudaSlice<f32>,
        trimap: &CudaSlice<u8>,
        use_trimap: bool,
        n: u32,
        alpha: &mut CudaSlice<u8>,
        cutout: Option<(&CudaSlice<u8>, &mut CudaSlice<u8>)>,
    ) -> Result<(), CudaError> {
        let n64 = u64::from(n);
        need("refined alpha", refined, n64)?;
        need("alpha", alpha, n64)?;
        if use_trimap {
            need("trimap", trimap, n64)?;
        }
        let use_trimap = i32::from(use_trimap);
        match cutout {
            None => {
                launch!(self, "quantize_alpha", n64, BLOCK; refined, trimap, &use_trimap, &n, alpha)
            }
            Some((rgb, rgba)) => {
                need("rgb", rgb, n64 * 3)?;
                // Bytes here, a u32 a pixel in the kernel (aligned: see guided_alpha).
                need("rgba", rgba, n64 * 4)?;
                launch!(self, "quantize_alpha_cutout", n64, BLOCK;
                    refined, trimap, &use_trimap, rgb, &n, alpha, rgba)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guided_fit_launches_cover_every_row_and_column() {
        let known = super::super::kernels::GUIDED_FILTER.kernels;
        for (w, h) in [(1u32, 1u32), (7, 5), (33, 17), (1008, 756), (4032, 3024)] {
            let [rows_guide, columns_coefficients, rows_coefficients, columns_means] =
                guided_fit_launches((w, h));
            for launch in [
                rows_guide,
                columns_coefficients,
                rows_coefficients,
                columns_means,
            ] {
                assert!(known.contains(&launch.kernel), "{}", launch.kernel);
            }
            // One-warp row blocks own 8 rows (4 sums) or 16 rows (2 sums) each.
            assert_eq!(rows_guide.block, 32);
            assert_eq!(rows_guide.blocks(), u64::from(h.div_ceil(8)));
            assert_eq!(rows_coefficients.block, 32);
            assert_eq!(rows_coefficients.blocks(), u64::from(h.div_ceil(16)));
            assert_eq!(columns_coefficients.threads, u64::from(w));
            assert_eq!(columns_means.threads, u64::from(w));
        }
    }
}
