//! The driver's answers as Rust results: `DriverError` keeps the raw `CUresult` code and
//! the entry point that answered it, and says whether the GPU's context is lost
//! (`is_device_lost`). The codes celer knows are listed once, here (`KNOWN`), with the
//! CUDA version that introduced each; a code outside the list (a driver newer than celer)
//! counts as lost: an error celer cannot read is one it cannot recover from in place.

use std::ffi::{c_char, CStr};

use super::sys::{self, Answer, RawResult};
use crate::cuda::probe::CudaVersion;

/// Why a driver call failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DriverError {
    /// The driver answered `code` (not `CUDA_SUCCESS`) to `call`.
    Code { call: &'static str, code: RawResult },
    /// `call` could not be made: no driver library loads, or the driver does not export
    /// the entry point (it is older than the entry point).
    Unresolved { call: &'static str, reason: String },
    /// celer refused to make `call`: its arguments could not be right (a copy larger than
    /// its destination, a range past a buffer's end, ...). The driver was not asked.
    Refused { call: &'static str, reason: String },
}

impl DriverError {
    /// The entry point that failed (or would have been called).
    pub fn call(&self) -> &'static str {
        match self {
            Self::Code { call, .. }
            | Self::Unresolved { call, .. }
            | Self::Refused { call, .. } => call,
        }
    }

    /// The driver's `CUresult`, when the driver answered.
    pub fn code(&self) -> Option<RawResult> {
        match self {
            Self::Code { code, .. } => Some(*code),
            _ => None,
        }
    }

    /// Whether the GPU's context is lost: after these errors every later call in the
    /// context fails, for everything sharing it, until the context is destroyed (see
    /// `KNOWN` for which codes, and `is_lost_code`).
    pub fn is_device_lost(&self) -> bool {
        self.code().is_some_and(is_lost_code)
    }

    pub(crate) fn refused(call: &'static str, reason: impl Into<String>) -> Self {
        Self::Refused {
            call,
            reason: reason.into(),
        }
    }
}

impl std::fmt::Display for DriverError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Code { call, code } => write!(f, "{call}: {}", describe(*code)),
            Self::Unresolved { call, reason } => write!(f, "{call} cannot be called: {reason}"),
            Self::Refused { call, reason } => write!(f, "{call} not called: {reason}"),
        }
    }
}

impl std::error::Error for DriverError {}

impl Answer {
    /// `Ok` when the driver answered `CUDA_SUCCESS`.
    pub fn result(self) -> Result<(), DriverError> {
        match self.code {
            Ok(sys::SUCCESS) => Ok(()),
            Ok(code) => Err(DriverError::Code {
                call: self.call,
                code,
            }),
            Err(reason) => Err(DriverError::Unresolved {
                call: self.call,
                reason,
            }),
        }
    }
}

/// A code as the driver names and describes it: `CUDA_ERROR_ILLEGAL_ADDRESS (700): an
/// illegal memory access was encountered`. The driver answers `cuGetErrorName` only for
/// codes it defines: for any other, "unknown CUDA error code N" (with celer's name for it
/// where celer knows one the driver does not).
pub fn describe(code: RawResult) -> String {
    match (driver_text(code, true), driver_text(code, false)) {
        (Some(name), Some(text)) => format!("{name} ({code}): {text}"),
        (Some(name), None) => format!("{name} ({code})"),
        _ => match known(code) {
            Some(k) => format!(
                "{} ({code}; the driver does not know it, CUDA {} introduced it)",
                k.name, k.since
            ),
            None => format!("unknown CUDA error code {code}"),
        },
    }
}

/// `cuGetErrorName` (`name`) or `cuGetErrorString` of `code`, through the raw entry
/// points; `None` when the driver does not define the code (or cannot be asked).
fn driver_text(code: RawResult, name: bool) -> Option<String> {
    let mut text: *const c_char = std::ptr::null();
    // SAFETY: the out-pointer is valid for one write; the driver takes any integer code.
    let answer = unsafe {
        if name {
            sys::cuGetErrorName(code, &mut text)
        } else {
            sys::cuGetErrorString(code, &mut text)
        }
    };
    if answer.result().is_err() || text.is_null() {
        return None;
    }
    // SAFETY: on success the driver points `text` at a NUL-terminated string it owns for
    // the life of the process; it is copied at once.
    Some(
        unsafe { CStr::from_ptr(text) }
            .to_string_lossy()
            .into_owned(),
    )
}

/// Whether a code means the context is lost: a known code marked so in `KNOWN`, or any
/// code celer does not know.
pub fn is_lost_code(code: RawResult) -> bool {
    known(code).is_none_or(|k| k.lost)
}

/// A code celer knows: its name, the first CUDA version whose cuda.h has it, and whether
/// the context is lost after it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KnownCode {
    pub code: RawResult,
    pub name: &'static str,
    /// CUDA 12.2 (celer's floor) for every code that a 12.2 driver already has.
    pub since: CudaVersion,
    pub lost: bool,
}

/// What celer knows of `code`.
pub fn known(code: RawResult) -> Option<&'static KnownCode> {
    KNOWN.iter().find(|k| k.code == code)
}

/// Declares the known codes: a constant for each, and the `KNOWN` table.
macro_rules! codes {
    ($( $name:ident = $code:literal, since ($major:literal, $minor:literal), lost: $lost:literal; )*) => {
        /// The `CUresult` codes as constants, by their names in cuda.h.
        pub mod code {
            use super::RawResult;
            $( pub const $name: RawResult = $code; )*
        }

        /// Every code celer knows, in cuda.h's order.
        pub const KNOWN: &[KnownCode] = &[$(
            KnownCode {
                code: $code,
                name: stringify!($name),
                since: CudaVersion::new($major, $minor),
                lost: $lost,
            },
        )*];
    };
}

// Where these come from: `cudaError_enum` of CUDA's cuda.h, as cudarc 0.19.10 lists it for
// each CUDA version (src/driver/sys/mod.rs, one enum per `cuda-XXXXX` feature): the
// `cuda-12020` enum (celer's floor: every code marked 12.2, older ones included), then what
// `cuda-12030` (12.3), `cuda-12040` (12.4), `cuda-12080` (12.8), `cuda-13000` (13.0),
// `cuda-13010` (13.1), `cuda-13030` (13.3) and `cuda-13040` (13.4) add.
//
// `lost: true`: the context's error is sticky (CUDA's documentation of each: "the process
// ... must terminate and relaunch", or "the CUDA context cannot be used"): an illegal
// address or instruction, a kernel's hardware fault or timeout, an uncorrectable ECC or
// NVLink error, a destroyed context, and Hopper's error containment (CUDA_ERROR_CONTAINED,
// CUDA 12.8: "any further CUDA work will return the same error"). Every code not listed
// here counts as lost too (`is_lost_code`).
codes! {
    CUDA_SUCCESS = 0, since (12, 2), lost: false;
    CUDA_ERROR_INVALID_VALUE = 1, since (12, 2), lost: false;
    CUDA_ERROR_OUT_OF_MEMORY = 2, since (12, 2), lost: false;
    CUDA_ERROR_NOT_INITIALIZED = 3, since (12, 2), lost: false;
    CUDA_ERROR_DEINITIALIZED = 4, since (12, 2), lost: false;
    CUDA_ERROR_PROFILER_DISABLED = 5, since (12, 2), lost: false;
    CUDA_ERROR_PROFILER_NOT_INITIALIZED = 6, since (12, 2), lost: false;
    CUDA_ERROR_PROFILER_ALREADY_STARTED = 7, since (12, 2), lost: false;
    CUDA_ERROR_PROFILER_ALREADY_STOPPED = 8, since (12, 2), lost: false;
    CUDA_ERROR_STUB_LIBRARY = 34, since (12, 2), lost: false;
    CUDA_ERROR_CALL_REQUIRES_NEWER_DRIVER = 36, since (13, 0), lost: false;
    CUDA_ERROR_DEVICE_UNAVAILABLE = 46, since (12, 2), lost: false;
    CUDA_ERROR_MULTICAST_RESOURCE_FULL = 47, since (13, 4), lost: false;
    CUDA_ERROR_NO_DEVICE = 100, since (12, 2), lost: false;
    CUDA_ERROR_INVALID_DEVICE = 101, since (12, 2), lost: false;
    CUDA_ERROR_DEVICE_NOT_LICENSED = 102, since (12, 2), lost: false;
    CUDA_ERROR_INVALID_IMAGE = 200, since (12, 2), lost: false;
    CUDA_ERROR_INVALID_CONTEXT = 201, since (12, 2), lost: false;
    CUDA_ERROR_CONTEXT_ALREADY_CURRENT = 202, since (12, 2), lost: false;
    CUDA_ERROR_MAP_FAILED = 205, since (12, 2), lost: false;
    CUDA_ERROR_UNMAP_FAILED = 206, since (12, 2), lost: false;
    CUDA_ERROR_ARRAY_IS_MAPPED = 207, since (12, 2), lost: false;
    CUDA_ERROR_ALREADY_MAPPED = 208, since (12, 2), lost: false;
    CUDA_ERROR_NO_BINARY_FOR_GPU = 209, since (12, 2), lost: false;
    CUDA_ERROR_ALREADY_ACQUIRED = 210, since (12, 2), lost: false;
    CUDA_ERROR_NOT_MAPPED = 211, since (12, 2), lost: false;
    CUDA_ERROR_NOT_MAPPED_AS_ARRAY = 212, since (12, 2), lost: false;
    CUDA_ERROR_NOT_MAPPED_AS_POINTER = 213, since (12, 2), lost: false;
    CUDA_ERROR_ECC_UNCORRECTABLE = 214, since (12, 2), lost: true;
    CUDA_ERROR_UNSUPPORTED_LIMIT = 215, since (12, 2), lost: false;
    CUDA_ERROR_CONTEXT_ALREADY_IN_USE = 216, since (12, 2), lost: false;
    CUDA_ERROR_PEER_ACCESS_UNSUPPORTED = 217, since (12, 2), lost: false;
    CUDA_ERROR_INVALID_PTX = 218, since (12, 2), lost: false;
    CUDA_ERROR_INVALID_GRAPHICS_CONTEXT = 219, since (12, 2), lost: false;
    CUDA_ERROR_NVLINK_UNCORRECTABLE = 220, since (12, 2), lost: true;
    CUDA_ERROR_JIT_COMPILER_NOT_FOUND = 221, since (12, 2), lost: false;
    CUDA_ERROR_UNSUPPORTED_PTX_VERSION = 222, since (12, 2), lost: false;
    CUDA_ERROR_JIT_COMPILATION_DISABLED = 223, since (12, 2), lost: false;
    CUDA_ERROR_UNSUPPORTED_EXEC_AFFINITY = 224, since (12, 2), lost: false;
    CUDA_ERROR_UNSUPPORTED_DEVSIDE_SYNC = 225, since (12, 2), lost: false;
    CUDA_ERROR_CONTAINED = 226, since (12, 8), lost: true;
    CUDA_ERROR_INSUFFICIENT_LOADER_VERSION = 227, since (13, 4), lost: false;
    CUDA_ERROR_INVALID_SOURCE = 300, since (12, 2), lost: false;
    CUDA_ERROR_FILE_NOT_FOUND = 301, since (12, 2), lost: false;
    CUDA_ERROR_SHARED_OBJECT_SYMBOL_NOT_FOUND = 302, since (12, 2), lost: false;
    CUDA_ERROR_SHARED_OBJECT_INIT_FAILED = 303, since (12, 2), lost: false;
    CUDA_ERROR_OPERATING_SYSTEM = 304, since (12, 2), lost: false;
    CUDA_ERROR_INVALID_HANDLE = 400, since (12, 2), lost: false;
    CUDA_ERROR_ILLEGAL_STATE = 401, since (12, 2), lost: false;
    CUDA_ERROR_LOSSY_QUERY = 402, since (12, 3), lost: false;
    CUDA_ERROR_NOT_FOUND = 500, since (12, 2), lost: false;
    CUDA_ERROR_NOT_READY = 600, since (12, 2), lost: false;
    CUDA_ERROR_ILLEGAL_ADDRESS = 700, since (12, 2), lost: true;
    CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES = 701, since (12, 2), lost: false;
    CUDA_ERROR_LAUNCH_TIMEOUT = 702, since (12, 2), lost: true;
    CUDA_ERROR_LAUNCH_INCOMPATIBLE_TEXTURING = 703, since (12, 2), lost: false;
    CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED = 704, since (12, 2), lost: false;
    CUDA_ERROR_PEER_ACCESS_NOT_ENABLED = 705, since (12, 2), lost: false;
    CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE = 708, since (12, 2), lost: false;
    CUDA_ERROR_CONTEXT_IS_DESTROYED = 709, since (12, 2), lost: true;
    CUDA_ERROR_ASSERT = 710, since (12, 2), lost: false;
    CUDA_ERROR_TOO_MANY_PEERS = 711, since (12, 2), lost: false;
    CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712, since (12, 2), lost: false;
    CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED = 713, since (12, 2), lost: false;
    CUDA_ERROR_HARDWARE_STACK_ERROR = 714, since (12, 2), lost: true;
    CUDA_ERROR_ILLEGAL_INSTRUCTION = 715, since (12, 2), lost: true;
    CUDA_ERROR_MISALIGNED_ADDRESS = 716, since (12, 2), lost: true;
    CUDA_ERROR_INVALID_ADDRESS_SPACE = 717, since (12, 2), lost: true;
    CUDA_ERROR_INVALID_PC = 718, since (12, 2), lost: true;
    CUDA_ERROR_LAUNCH_FAILED = 719, since (12, 2), lost: true;
    CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE = 720, since (12, 2), lost: false;
    CUDA_ERROR_TENSOR_MEMORY_LEAK = 721, since (12, 8), lost: false;
    CUDA_ERROR_NOT_PERMITTED = 800, since (12, 2), lost: false;
    CUDA_ERROR_NOT_SUPPORTED = 801, since (12, 2), lost: false;
    CUDA_ERROR_SYSTEM_NOT_READY = 802, since (12, 2), lost: false;
    CUDA_ERROR_SYSTEM_DRIVER_MISMATCH = 803, since (12, 2), lost: false;
    CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE = 804, since (12, 2), lost: false;
    CUDA_ERROR_MPS_CONNECTION_FAILED = 805, since (12, 2), lost: false;
    CUDA_ERROR_MPS_RPC_FAILURE = 806, since (12, 2), lost: false;
    CUDA_ERROR_MPS_SERVER_NOT_READY = 807, since (12, 2), lost: false;
    CUDA_ERROR_MPS_MAX_CLIENTS_REACHED = 808, since (12, 2), lost: false;
    CUDA_ERROR_MPS_MAX_CONNECTIONS_REACHED = 809, since (12, 2), lost: false;
    CUDA_ERROR_MPS_CLIENT_TERMINATED = 810, since (12, 2), lost: false;
    CUDA_ERROR_CDP_NOT_SUPPORTED = 811, since (12, 2), lost: false;
    CUDA_ERROR_CDP_VERSION_MISMATCH = 812, since (12, 2), lost: false;
    CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED = 900, since (12, 2), lost: false;
    CUDA_ERROR_STREAM_CAPTURE_INVALIDATED = 901, since (12, 2), lost: false;
    CUDA_ERROR_STREAM_CAPTURE_MERGE = 902, since (12, 2), lost: false;
    CUDA_ERROR_STREAM_CAPTURE_UNMATCHED = 903, since (12, 2), lost: false;
    CUDA_ERROR_STREAM_CAPTURE_UNJOINED = 904, since (12, 2), lost: false;
    CUDA_ERROR_STREAM_CAPTURE_ISOLATION = 905, since (12, 2), lost: false;
    CUDA_ERROR_STREAM_CAPTURE_IMPLICIT = 906, since (12, 2), lost: false;
    CUDA_ERROR_CAPTURED_EVENT = 907, since (12, 2), lost: false;
    CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD = 908, since (12, 2), lost: false;
    CUDA_ERROR_TIMEOUT = 909, since (12, 2), lost: false;
    CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE = 910, since (12, 2), lost: false;
    CUDA_ERROR_EXTERNAL_DEVICE = 911, since (12, 2), lost: false;
    CUDA_ERROR_INVALID_CLUSTER_SIZE = 912, since (12, 2), lost: false;
    CUDA_ERROR_FUNCTION_NOT_LOADED = 913, since (12, 4), lost: false;
    CUDA_ERROR_INVALID_RESOURCE_TYPE = 914, since (12, 4), lost: false;
    CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION = 915, since (12, 4), lost: false;
    CUDA_ERROR_KEY_ROTATION = 916, since (12, 8), lost: false;
    CUDA_ERROR_STREAM_DETACHED = 917, since (13, 1), lost: false;
    CUDA_ERROR_GRAPH_RECAPTURE_FAILURE = 918, since (13, 3), lost: false;
    CUDA_ERROR_FABRIC_NOT_READY = 919, since (13, 4), lost: false;
    CUDA_ERROR_UNKNOWN = 999, since (12, 2), lost: false;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sticky_codes_containment_and_unknown_codes_are_lost() {
        for lost in [214, 220, 226, 700, 702, 709, 714, 715, 716, 717, 718, 719] {
            assert!(is_lost_code(lost), "{lost}");
        }
        for usable in [1, 2, 201, 400, 600, 701, 712, 713, 721, 801, 999] {
            assert!(!is_lost_code(usable), "{usable}");
        }
        // Not in any cuda.h celer knows: a newer driver's, read conservatively.
        assert!(known(1000).is_none() && is_lost_code(1000));
        assert!(is_lost_code(u32::MAX));
        let contained = known(code::CUDA_ERROR_CONTAINED).unwrap();
        assert_eq!(contained.since, CudaVersion::new(12, 8));
    }

    #[test]
    fn the_table_has_each_code_once_in_order() {
        for pair in KNOWN.windows(2) {
            assert!(pair[0].code < pair[1].code, "{:?}", pair);
        }
        assert!(KNOWN
            .iter()
            .all(|k| k.name.starts_with("CUDA_") && k.since >= CudaVersion::new(12, 2)));
    }

    #[test]
    fn errors_name_their_call_and_code_and_say_whether_the_context_is_lost() {
        let lost = DriverError::Code {
            call: "cuStreamSynchronize",
            code: 1000,
        };
        assert!(lost.is_device_lost());
        assert_eq!(lost.code(), Some(1000));
        assert_eq!(lost.call(), "cuStreamSynchronize");
        let refused = DriverError::refused("cuMemcpyHtoDAsync_v2", "too large");
        assert!(!refused.is_device_lost());
        assert_eq!(refused.code(), None);
        assert!(refused.to_string().contains("cuMemcpyHtoDAsync_v2"));
    }
}
