//! The stages of one request and their CPU implementations, each a function of its
//! inputs: the reference every CUDA kernel is tested against.
//!
//! ```text
//! bytes -decode-> RGB8 -preprocess-> NCHW f32 -segmentation-> mask -> trimap
//!   -> matting (guided filter or model) -> alpha at source size -composite/encode-> PNG
//! ```
//!
//! Decode and encode are `crate::codec`'s (they run on the blocking pool); a CPU replica
//! runs these stages in order around its models (`crate::replica::cpu`), a GPU replica
//! runs their kernels (`crate::replica::gpu`). See docs/architecture.md.

pub mod composite;
pub mod guided_filter;
pub mod lanes;
pub mod plane;
pub mod preprocess;
pub mod resample;
pub mod trimap;

/// An RGB8 image in any container of bytes: a heap vector, or the host block a request's
/// decoder wrote.
pub type Rgb8<C> = image::ImageBuffer<image::Rgb<u8>, C>;

/// A one-channel 8-bit plane (an alpha, a trimap) in any container of bytes.
pub type Gray8<C> = image::ImageBuffer<image::Luma<u8>, C>;

/// What an `Rgb8` may keep its bytes in (read by several threads at once where a stage
/// splits its rows).
pub trait Bytes: std::ops::Deref<Target = [u8]> + Sync {}

impl<T: std::ops::Deref<Target = [u8]> + Sync> Bytes for T {}

/// Why a stage refused what it was given: a model output of another shape than the stage
/// reads, or a resize the resampling library refused. The server's fault (its models or
/// their description), never the client's.
#[derive(Debug, thiserror::Error)]
pub enum StageError {
    #[error("expected an output of shape [1, C, H, W], got {0:?}")]
    OutputShape(Vec<usize>),
    #[error("the output has {outputs} classes, the pipeline description maps {mapped}")]
    Classes { outputs: usize, mapped: usize },
    #[error(transparent)]
    Buffer(#[from] fast_image_resize::ImageBufferError),
    #[error(transparent)]
    Resize(#[from] fast_image_resize::ResizeError),
}
