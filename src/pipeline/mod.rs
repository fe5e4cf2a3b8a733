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

use std::time::Duration;

use image::GrayImage;
use serde::Serialize;

/// The result of the device stages for one image, at the source size.
#[derive(Debug, Clone)]
pub struct Matte {
    pub alpha: GrayImage,
    pub trimap: GrayImage,
}

/// Wall time of each stage of one request. Zero for a stage that did not run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct StageTimings {
    #[serde(serialize_with = "as_ms")]
    pub decode: Duration,
    #[serde(serialize_with = "as_ms")]
    pub preprocess: Duration,
    #[serde(serialize_with = "as_ms")]
    pub model: Duration,
    #[serde(serialize_with = "as_ms")]
    pub trimap: Duration,
    #[serde(serialize_with = "as_ms")]
    pub matting: Duration,
    #[serde(serialize_with = "as_ms")]
    pub composite: Duration,
    #[serde(serialize_with = "as_ms")]
    pub encode: Duration,
}

fn as_ms<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64() * 1e3)
}

impl StageTimings {
    /// `(name, duration)` for each stage, in pipeline order.
    pub fn stages(&self) -> [(&'static str, Duration); 7] {
        [
            ("decode", self.decode),
            ("preprocess", self.preprocess),
            ("model", self.model),
            ("trimap", self.trimap),
            ("matting", self.matting),
            ("composite", self.composite),
            ("encode", self.encode),
        ]
    }
}
