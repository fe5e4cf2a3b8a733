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
