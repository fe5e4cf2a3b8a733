//! A GPU request's stage times. Kernels and engines run asynchronously, so their time is
//! read from events recorded on the stream between the stages, once the stream has run
//! them; the host's parts (ONNX Runtime, the download's wait) are wall time.

use std::sync::Arc;
use std::time::Duration;

use crate::cuda::driver::{CudaEvent, CudaStream};

use crate::cuda::{CudaError, GpuDevice};
use crate::matte::StageTimings;

/// Where the stream stands between stages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mark {
    Start,
    /// The model inputs are written.
    Preprocessed,
    /// The segmentation output is on the device.
    MaskReady,
    Trimapped,
    /// Matting is done: the guided filter's fit, or the matting model and its resize.
    Matted,
    /// Alpha (and the cut-out) are made.
    Composited,
}

const MARKS: usize = 6;

/// One event per mark, made with timing.
pub struct StageClock {
    events: [CudaEvent; MARKS],
}

/// Where the models ran, which decides which times the events give.
#[derive(Debug, Clone, Copy)]
pub struct ModelPlaces {
    pub segmentation_on_gpu: bool,
    pub matting_model_on_gpu: bool,
    pub guided: bool,
}

impl StageClock {
    pub fn new(device: &GpuDevice) -> Result<Self, CudaError> {
        Ok(Self {
            events: [
                device.timing_event()?,
                device.timing_event()?,
                device.timing_event()?,
                device.timing_event()?,
                device.timing_event()?,
                device.timing_event()?,
            ],
        })
    }

    /// Records `mark` where the stream is now.
    pub fn mark(&self, mark: Mark, stream: &Arc<CudaStream>) -> Result<(), CudaError> {
        self.events[mark as usize].record(stream)?;
        Ok(())
    }

    fn between(&self, from: Mark, to: Mark) -> Duration {
        self.events[from as usize]
            .elapsed_ms(&self.events[to as usize])
            .map(|ms| Duration::from_secs_f64(f64::from(ms.max(0.0)) / 1e3))
            .unwrap_or_default()
    }

    /// Fills the GPU stages' times once the stream has run them, adding to the host's
    /// parts already in `timings` (ONNX Runtime's model time, `download`: the download's
    /// wait).
    pub fn read(&self, places: ModelPlaces, download: Duration, timings: &mut StageTimings) {
        use Mark::*;
        timings.trimap = self.between(MaskReady, Trimapped);
        if places.segmentation_on_gpu {
            // Nothing waited for the GPU before the end: its stages are event times.
            timings.preprocess = self.between(Start, Preprocessed);
            timings.model = self.between(Preprocessed, MaskReady);
        }
        if places.matting_model_on_gpu {
            // The matting model with its input resize and its alpha's resize.
            timings.model += self.between(Trimapped, Matted);
        }
        if places.guided {
            // The guided filter's alpha pass is its apply step: matting time.
            timings.matting = self.between(Trimapped, Composited);
            timings.composite = download;
        } else {
            timings.composite = self.between(Matted, Composited) + download;
        }
    }
}
