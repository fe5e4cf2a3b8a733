//! What running the pipeline on one image gives: the alpha matte and the trimap at the
//! source size, and the wall time of each stage. Made by either device's replica, read by
//! the codec (render), the HTTP layer (Server-Timing) and the benchmarks. The ground floor,
//! with the host memory its planes live in (`crate::pixels`).

use std::time::Duration;

use image::{GrayImage, RgbaImage};
use serde::Serialize;

use crate::pixels::{self, GrayPixels, RgbaPixels};

/// The result of the device stages for one image, at the source size. On the CPU its
/// planes are blocks of the server's pixel allocator (`crate::pixels`), read by the
/// encoder where the replica wrote them.
#[derive(Debug, Clone)]
pub struct Matte {
    pub alpha: GrayPixels,
    pub trimap: GrayPixels,
}

impl Matte {
    /// The alpha as a heap image (a copy only if its bytes were leased).
    pub fn into_alpha_image(self) -> GrayImage {
        pixels::into_image(self.alpha)
    }

    /// A matte whose planes are heap vectors.
    pub fn from_images(alpha: GrayImage, trimap: GrayImage) -> Self {
        Self {
            alpha: pixels::from_image(alpha),
            trimap: pixels::from_image(trimap),
        }
    }
}

/// Which planes an answer shows, and so which a device hands back: a GPU downloads only
/// these (a cut-out's alpha travels inside it), the CPU composites the cut-out only when
/// it is asked for.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Planes {
    pub alpha: bool,
    pub trimap: bool,
    pub cutout: bool,
}

impl Planes {
    pub const ALL: Planes = Planes {
        alpha: true,
        trimap: true,
        cutout: true,
    };
    pub const ALPHA: Planes = Planes {
        alpha: true,
        trimap: false,
        cutout: false,
    };
    pub const CUTOUT: Planes = Planes {
        alpha: false,
        trimap: false,
        cutout: true,
    };
}

/// A plane an answer needed that the device did not hand back: the server's fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the device did not hand back the {0} plane")]
pub struct MissingPlane(pub &'static str);

/// What a device hands back for one image: the planes asked for (others may be there
/// too, where they cost nothing), at the source size. A GPU's planes are the blocks its
/// download wrote, read by the encoder where they are.
#[derive(Debug, Clone)]
pub struct MattePlanes {
    pub width: u32,
    pub height: u32,
    pub alpha: Option<GrayPixels>,
    pub trimap: Option<GrayPixels>,
    pub cutout: Option<RgbaPixels>,
}

impl MattePlanes {
    /// The CPU's result: alpha and trimap always (they are made anyway), the cut-out
    /// when it was composited.
    pub fn from_matte(matte: Matte, cutout: Option<RgbaImage>) -> Self {
        let (width, height) = matte.alpha.dimensions();
        Self {
            width,
            height,
            alpha: Some(matte.alpha),
            trimap: Some(matte.trimap),
            cutout: cutout.map(pixels::from_image),
        }
    }

    pub fn dimensions(&self) -> (u32, u32) {
        (self.width, self.height)
    }

    pub fn alpha(&self) -> Result<&GrayPixels, MissingPlane> {
        self.alpha.as_ref().ok_or(MissingPlane("alpha"))
    }

    pub fn trimap(&self) -> Result<&GrayPixels, MissingPlane> {
        self.trimap.as_ref().ok_or(MissingPlane("trimap"))
    }

    pub fn cutout(&self) -> Result<&RgbaPixels, MissingPlane> {
        self.cutout.as_ref().ok_or(MissingPlane("cut-out"))
    }
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
