//! The shim's status codes as `Result`s, and the values that cross the C boundary
//! (names, shapes, tensor descriptions, log messages) in Rust form. Each failed call
//! becomes a `TrtError` carrying the message the shim kept for the calling thread, so
//! `check` must run on the thread that made the call, right after it.

use std::ffi::{c_char, CStr, CString};

use super::sys;
use super::types::{DataType, TensorDesc, TrtError};

/// `Ok` for `CELER_TRT_OK`, else the shim's message for this thread.
pub(crate) fn check(status: sys::celer_trt_status, call: &'static str) -> Result<(), TrtError> {
    match status {
        sys::CELER_TRT_OK => Ok(()),
        sys::CELER_TRT_NOT_FOUND => Err(TrtError::LibraryNotFound(last_error())),
        _ => Err(TrtError::Call {
            call,
            message: last_error(),
        }),
    }
}

/// The message of the last failed shim call on this thread.
pub(crate) fn last_error() -> String {
    // SAFETY: the shim returns a pointer to a thread-local NUL-terminated string that
    // stays valid until the next shim call on this thread; it is copied at once.
    let message = unsafe { string_at(sys::celer_trt_last_error()) };
    if message.is_empty() {
        "failed without a message".into()
    } else {
        message
    }
}

/// Copies a C string owned by the shim or TensorRT; null reads as empty.
///
/// # Safety
/// `ptr` is null or points to a NUL-terminated string valid for the call.
pub(crate) unsafe fn string_at(ptr: *const c_char) -> String {
    if ptr.is_null() {
        return String::new();
    }
    // SAFETY: non-null and NUL-terminated by the caller's contract.
    unsafe { CStr::from_ptr(ptr) }
        .to_string_lossy()
        .into_owned()
}

/// A tensor name as TensorRT takes it.
pub(crate) fn c_name(name: &str) -> Result<CString, TrtError> {
    CString::new(name)
        .map_err(|_| TrtError::InvalidArgument(format!("tensor name {name:?} contains NUL")))
}

pub(crate) fn path_arg(path: &std::path::Path) -> Result<CString, TrtError> {
    use std::os::unix::ffi::OsStrExt;
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| TrtError::InvalidArgument(format!("path {} contains NUL", path.display())))
}

pub(crate) fn dims_to_vec(dims: &sys::celer_trt_dims) -> Vec<i64> {
    let rank = dims.nb_dims.clamp(0, sys::CELER_TRT_MAX_DIMS as i32) as usize;
    dims.d[..rank].to_vec()
}

pub(crate) fn dims_from(shape: &[i64]) -> Result<sys::celer_trt_dims, TrtError> {
    let max = sys::CELER_TRT_MAX_DIMS as usize;
    if shape.len() > max {
        return Err(TrtError::InvalidArgument(format!(
            "shape {shape:?} has more than {max} dimensions"
        )));
    }
    let mut dims = sys::celer_trt_dims {
        nb_dims: shape.len() as i32,
        d: [0; sys::CELER_TRT_MAX_DIMS as usize],
    };
    dims.d[..shape.len()].copy_from_slice(shape);
    Ok(dims)
}

/// Copies a tensor description filled by the shim.
///
/// # Safety
/// `raw.name` is null or a NUL-terminated string valid for the call.
pub(crate) unsafe fn tensor_desc(raw: &sys::celer_trt_tensor_desc) -> TensorDesc {
    TensorDesc {
        // SAFETY: the caller's contract.
        name: unsafe { string_at(raw.name) },
        is_input: raw.is_input != 0,
        data_type: DataType::from_code(raw.data_type),
        shape: dims_to_vec(&raw.shape),
    }
}

/// TensorRT's logger, forwarded to `tracing` under the target `tensorrt`. INFO is
/// logged at debug level: TensorRT is chatty (memory usage lines on every load).
pub(crate) extern "C" fn log_message(severity: i32, message: *const c_char) {
    // A panic must not unwind into C++ (it would abort); a logging failure is dropped.
    let _ = std::panic::catch_unwind(|| {
        // SAFETY: TensorRT passes a NUL-terminated message valid during the call.
        let text = || unsafe { string_at(message) };
        match severity {
            0 => tracing::error!(target: "tensorrt", "internal error: {}", text()),
            1 => tracing::error!(target: "tensorrt", "{}", text()),
            2 => tracing::warn!(target: "tensorrt", "{}", text()),
            3 => tracing::debug!(target: "tensorrt", "{}", text()),
            _ => tracing::trace!(target: "tensorrt", "{}", text()),
        }
    });
}
