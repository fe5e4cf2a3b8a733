//! What running the pipeline on one image gives: the alpha matte and the trimap at the
//! source size, and the wall time of each stage. Made by either device's replica, read by
//! the codec (render), the HTTP layer (Server-Timing) and the benchmarks. The ground floor.

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
