//! The vocabulary shared by the TensorRT wrappers, their stand-in and the engine
//! manifest: errors, versions, element types, tensor descriptions, precisions, the two raw
//! CUDA handles that cross the boundary (streams and device pointers), and the scope in
//! which the owner of a CUDA context makes it current. Compiled with or without the
//! `tensorrt` feature; nothing here calls TensorRT.

use std::ffi::c_void;
use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// A TensorRT failure, said so that an operator can act on it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TrtError {
    #[error(
        "celer was built without TensorRT (cargo feature `tensorrt`); rebuild with `make build` \
         (it fetches TensorRT's headers), or `TENSORRT_INCLUDE_DIR=<TensorRT include dir> cargo \
         build --release --features tensorrt`"
    )]
    NotBuilt,
    /// libnvinfer / libnvonnxparser is not installed where the loader looks.
    #[error("TensorRT library not found: {0}")]
    LibraryNotFound(String),
    /// A TensorRT library was found but cannot be used: wrong version, not TensorRT.
    #[error("TensorRT library: {0}")]
    Library(String),
    /// A shim call failed; `message` carries TensorRT's own error where it logged one.
    #[error("TensorRT {call}: {message}")]
    Call { call: &'static str, message: String },
    #[error("invalid argument to TensorRT: {0}")]
    InvalidArgument(String),
}

/// Text that names no TensorRT version or precision (an engine manifest's field, an
/// argument of `celer build`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TrtParseError {
    #[error("`{0}` is not a version like 10.16.0")]
    Version(String),
    #[error("`{0}` is not one of fp32, fp16, bf16")]
    Precision(String),
}

/// A TensorRT version, `major.minor.patch`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TrtVersion {
    pub major: u32,
    pub minor: u32,
    pub patch: u32,
}

impl TrtVersion {
    /// Decodes `getInferLibVersion()`: `major * 10000 + minor * 100 + patch` from 10.0,
    /// `major * 1000 + minor * 100 + patch` before (so that an old library is named right).
    pub fn from_encoded(v: i32) -> Self {
        let v = v.max(0) as u32;
        if v >= 10_000 {
            Self {
                major: v / 10_000,
                minor: (v / 100) % 100,
                patch: v % 100,
            }
        } else {
            Self {
                major: v / 1000,
                minor: (v / 100) % 10,
                patch: v % 100,
            }
        }
    }
}

impl fmt::Display for TrtVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

impl FromStr for TrtVersion {
    type Err = TrtParseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let parts: Vec<&str> = s.trim().split('.').collect();
        let number = |i: usize| -> Result<u32, TrtParseError> {
            parts
                .get(i)
                .map_or(Ok(0), |p| p.parse::<u32>())
                .map_err(|_| TrtParseError::Version(s.to_string()))
        };
        if parts.is_empty() || parts.len() > 3 {
            return Err(TrtParseError::Version(s.to_string()));
        }
        Ok(Self {
            major: number(0)?,
            minor: number(1)?,
            patch: number(2)?,
        })
    }
}

impl Serialize for TrtVersion {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for TrtVersion {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

/// Element type of a tensor, as TensorRT names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DataType {
    Float,
    Half,
    Int8,
    Int32,
    Bool,
    Uint8,
    Fp8,
    Bf16,
    Int64,
    Int4,
    Fp4,
    E8m0,
    Unknown,
}

impl DataType {
    /// From the shim's `celer_trt_data_type` code (TensorRT's own numbering).
    pub fn from_code(code: i32) -> Self {
        match code {
            0 => Self::Float,
            1 => Self::Half,
            2 => Self::Int8,
            3 => Self::Int32,
            4 => Self::Bool,
            5 => Self::Uint8,
            6 => Self::Fp8,
            7 => Self::Bf16,
            8 => Self::Int64,
            9 => Self::Int4,
            10 => Self::Fp4,
            11 => Self::E8m0,
            _ => Self::Unknown,
        }
    }
}

impl fmt::Display for DataType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self {
            Self::Float => "float32",
            Self::Half => "float16",
            Self::Int8 => "int8",
            Self::Int32 => "int32",
            Self::Bool => "bool",
            Self::Uint8 => "uint8",
            Self::Fp8 => "fp8",
            Self::Bf16 => "bfloat16",
            Self::Int64 => "int64",
            Self::Int4 => "int4",
            Self::Fp4 => "fp4",
            Self::E8m0 => "e8m0",
            Self::Unknown => "unknown",
        };
        f.write_str(name)
    }
}

/// One input or output of an engine or a parsed network. `shape` has -1 for a dynamic
/// dimension.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorDesc {
    pub name: String,
    pub is_input: bool,
    pub data_type: DataType,
    pub shape: Vec<i64>,
}

/// Min / opt / max shapes of one input in an optimisation profile.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InputProfile {
    pub name: String,
    pub min: Vec<i64>,
    pub opt: Vec<i64>,
    pub max: Vec<i64>,
}

/// The arithmetic precision an engine is built for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Precision {
    Fp32,
    Fp16,
    Bf16,
    /// TensorRT 11: networks are strongly typed, each layer runs in its ONNX type.
    FromModel,
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Fp32 => "fp32",
            Self::Fp16 => "fp16",
            Self::Bf16 => "bf16",
            Self::FromModel => "from-model",
        })
    }
}

impl FromStr for Precision {
    type Err = TrtParseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "fp32" | "float32" => Ok(Self::Fp32),
            "fp16" | "float16" | "half" => Ok(Self::Fp16),
            "bf16" | "bfloat16" => Ok(Self::Bf16),
            other => Err(TrtParseError::Precision(other.to_string())),
        }
    }
}

/// Where to find the TensorRT libraries: a file path, or a soname for the dynamic
/// loader (which searches LD_LIBRARY_PATH and the system's library cache).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LibraryPaths {
    pub nvinfer: PathBuf,
    pub nvonnxparser: PathBuf,
}

/// A CUDA stream (`cudaStream_t` / `CUstream`) owned by the caller, typically a
/// replica's stream from the cuda module. TensorRT only enqueues work on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaStream(*mut c_void);

impl CudaStream {
    /// The legacy default stream (synchronises with every other blocking stream).
    pub const DEFAULT: Self = Self(std::ptr::null_mut());

    /// Wraps a raw stream handle.
    ///
    /// # Safety
    /// `raw` must be a stream of the CUDA context current on the threads that enqueue on
    /// it, and stay alive until that work has completed.
    pub unsafe fn from_raw(raw: *mut c_void) -> Self {
        Self(raw)
    }

    pub fn as_raw(self) -> *mut c_void {
        self.0
    }
}

// SAFETY: A stream handle is an opaque token that the CUDA driver accepts from any host
// thread (the driver API is thread-safe); `CudaStream` never dereferences it.
unsafe impl Send for CudaStream {}
// SAFETY: As for Send; sharing the token gives no access beyond copying it.
unsafe impl Sync for CudaStream {}

/// An address in device memory (a `CUdeviceptr` as a pointer), owned by the caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DevicePtr(*mut c_void);

impl DevicePtr {
    /// Wraps a raw device address.
    ///
    /// # Safety
    /// `raw` must point to device memory of the current CUDA context, large enough for
    /// the tensor it is bound to, and stay allocated until the work using it completes.
    pub unsafe fn from_raw(raw: *mut c_void) -> Self {
        Self(raw)
    }

    pub fn as_raw(self) -> *mut c_void {
        self.0
    }
}

// SAFETY: A device address is a number that host code never dereferences; the CUDA
// driver accepts it from any host thread.
unsafe impl Send for DevicePtr {}
// SAFETY: As for Send.
unsafe impl Sync for DevicePtr {}

/// The CUDA context a runtime's engines live in, as its owner makes it current. TensorRT
/// works in the context current on the calling thread: it deserialises an engine into it,
/// and frees an engine's or an execution context's device memory through it when they are
/// destroyed (with no context current, or another GPU's, that memory leaks or is freed in
/// the wrong place). So the safe types make, and destroy, every runtime object inside
/// `with_current`. Implemented by the owner of the context (celer's `crate::cuda`): this
/// module calls no CUDA itself.
pub trait CudaContextScope: Send + Sync {
    /// Runs `f` with the context current on the calling thread, then makes the thread's
    /// previous context (or none) current again. `Err` (why) when the context cannot be
    /// made current; `f` has not run then.
    fn with_current(&self, f: &mut dyn FnMut()) -> Result<(), String>;
}

/// A build-progress event from TensorRT's builder (IProgressMonitor).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BuildProgress<'a> {
    PhaseStart {
        phase: &'a str,
        parent: Option<&'a str>,
        steps: i32,
    },
    Step {
        phase: &'a str,
        step: i32,
    },
    PhaseFinish {
        phase: &'a str,
    },
}

/// How to build one engine.
#[derive(Debug, Clone, PartialEq)]
pub struct BuildSettings {
    pub precision: Precision,
    /// Builder workspace limit; `None` leaves TensorRT's default (the device's memory).
    pub workspace_bytes: Option<u64>,
    /// One optimisation profile; empty when every input has a static shape.
    pub profile: Vec<InputProfile>,
    /// A serialized timing cache to start from (it is refused, and a new one started,
    /// when it comes from another GPU or TensorRT version).
    pub timing_cache: Option<Vec<u8>>,
}

/// The result of a build: the plan and the timing cache to save for the next build.
#[derive(Debug, Clone)]
pub struct BuiltEngine {
    pub plan: Vec<u8>,
    pub timing_cache: Option<Vec<u8>>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_decode_both_encodings() {
        let v = TrtVersion::from_encoded(101600);
        assert_eq!((v.major, v.minor, v.patch), (10, 16, 0));
        assert_eq!(TrtVersion::from_encoded(110102).to_string(), "11.1.2");
        assert_eq!(TrtVersion::from_encoded(8601).to_string(), "8.6.1");
        assert_eq!("10.16".parse::<TrtVersion>().unwrap(), v);
        assert!("ten".parse::<TrtVersion>().is_err());
    }

    #[test]
    fn precision_words() {
        assert_eq!("FP16".parse::<Precision>().unwrap(), Precision::Fp16);
        assert_eq!("bfloat16".parse::<Precision>().unwrap(), Precision::Bf16);
        assert!("int8"
            .parse::<Precision>()
            .unwrap_err()
            .to_string()
            .contains("fp32"));
        assert_eq!(
            serde_json::to_string(&Precision::FromModel).unwrap(),
            "\"from-model\""
        );
    }
}
