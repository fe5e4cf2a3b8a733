//! Building engines: an ONNX model parsed into a TensorRT network, then built into a
//! serialized plan with one optimisation profile, a precision, a workspace limit and a
//! timing cache. Builds run on the CUDA device current on the calling thread; choosing
//! it is the caller's job (see `crate::cuda::device::bind`), and so is keeping it current
//! until the network is dropped: the builder is destroyed in the context it was made in.
//! Writing files is `store`'s.

use std::ffi::{c_char, c_void};
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::Arc;

use super::result::{self, check};
use super::runtime::{null_from, Library, TensorRt};
use super::sys;
use super::types::{BuildProgress, BuildSettings, BuiltEngine, Precision, TensorDesc, TrtError};

/// An ONNX model parsed into a TensorRT network, with the builder that will build it.
/// Neither Send nor Sync (the raw pointer): it is made, built and dropped on one thread,
/// inside the caller's binding of the GPU's context, in which TensorRT's builder works
/// and is destroyed.
pub struct Network {
    raw: NonNull<sys::celer_trt_network>,
    source: PathBuf,
    _lib: Arc<Library>,
}

impl Drop for Network {
    fn drop(&mut self) {
        // SAFETY: created by celer_trt_network_parse and destroyed once; the shim
        // destroys the parser before the network and the builder after both. The
        // libraries (`_lib`) are released after this.
        unsafe { sys::celer_trt_network_destroy(self.raw.as_ptr()) }
    }
}

impl TensorRt {
    /// Parses `onnx` into a network (needs [`TensorRt::load_builder`]).
    pub fn parse_onnx(&self, onnx: &Path) -> Result<Network, TrtError> {
        let lib = self.library();
        if !lib.has_parser {
            return Err(TrtError::Library(
                "the ONNX parser is not loaded (use TensorRt::load_builder)".into(),
            ));
        }
        let path = result::path_arg(onnx)?;
        let mut raw = std::ptr::null_mut();
        check(
            // SAFETY: the library (with its parser) is open; `path` outlives the call; `raw`
            // is a valid out pointer.
            unsafe { sys::celer_trt_network_parse(lib.raw.as_ptr(), path.as_ptr(), &mut raw) },
            "ONNX parser",
        )?;
        let raw = NonNull::new(raw).ok_or_else(|| null_from("ONNX parser"))?;
        Ok(Network {
            raw,
            source: onnx.to_path_buf(),
            _lib: lib.clone(),
        })
    }
}

impl Network {
    pub fn source(&self) -> &Path {
        &self.source
    }

    pub fn inputs(&self) -> Result<Vec<TensorDesc>, TrtError> {
        self.tensors(true)
    }

    pub fn outputs(&self) -> Result<Vec<TensorDesc>, TrtError> {
        self.tensors(false)
    }

    fn tensors(&self, inputs: bool) -> Result<Vec<TensorDesc>, TrtError> {
        let (mut n_in, mut n_out) = (0, 0);
        check(
            // SAFETY: the network is alive; the counts are valid out pointers.
            unsafe { sys::celer_trt_network_io_count(self.raw.as_ptr(), &mut n_in, &mut n_out) },
            "network I/O",
        )?;
        let count = if inputs { n_in } else { n_out };
        let mut list = Vec::with_capacity(count.max(0) as usize);
        for index in 0..count {
            // SAFETY: all-zero is a valid celer_trt_tensor_desc.
            let mut desc: sys::celer_trt_tensor_desc = unsafe { std::mem::zeroed() };
            check(
                // SAFETY: the network is alive; `desc` is a valid out pointer.
                unsafe {
                    sys::celer_trt_network_io_tensor(
                        self.raw.as_ptr(),
                        i32::from(inputs),
                        index,
                        &mut desc,
                    )
                },
                "network I/O",
            )?;
            // SAFETY: the name is owned by the network, alive during this copy.
            list.push(unsafe { result::tensor_desc(&desc) });
        }
        Ok(list)
    }

    /// Builds a plan on the current CUDA device. `progress` hears TensorRT's build phases
    /// (possibly from TensorRT's own threads, hence `Sync`).
    pub fn build(
        &mut self,
        settings: &BuildSettings,
        progress: &(dyn Fn(BuildProgress<'_>) + Sync),
    ) -> Result<BuiltEngine, TrtError> {
        let names = settings
            .profile
            .iter()
            .map(|p| result::c_name(&p.name))
            .collect::<Result<Vec<_>, _>>()?;
        let mut entries = Vec::with_capacity(names.len());
        for (profile, name) in settings.profile.iter().zip(&names) {
            entries.push(sys::celer_trt_profile_entry {
                name: name.as_ptr(),
                min: result::dims_from(&profile.min)?,
                opt: result::dims_from(&profile.opt)?,
                max: result::dims_from(&profile.max)?,
            });
        }
        let precision = match settings.precision {
            Precision::Fp32 => sys::CELER_TRT_PRECISION_FP32,
            Precision::Fp16 => sys::CELER_TRT_PRECISION_FP16,
            Precision::Bf16 => sys::CELER_TRT_PRECISION_BF16,
            Precision::FromModel => sys::CELER_TRT_PRECISION_FROM_MODEL,
        };
        let cache = settings.timing_cache.as_deref().unwrap_or(&[]);
        // The trampoline receives a pointer to this fat reference.
        let mut callback: &(dyn Fn(BuildProgress<'_>) + Sync) = progress;
        let options = sys::celer_trt_build_options {
            precision: precision as i32,
            workspace_bytes: settings.workspace_bytes.unwrap_or(0),
            timing_cache: if cache.is_empty() {
                std::ptr::null()
            } else {
                cache.as_ptr().cast::<c_void>()
            },
            timing_cache_size: cache.len(),
            progress: Some(progress_trampoline),
            progress_user: (&mut callback as *mut &(dyn Fn(BuildProgress<'_>) + Sync))
                .cast::<c_void>(),
        };
        let (mut plan, mut timing_cache) = (std::ptr::null_mut(), std::ptr::null_mut());
        check(
            // SAFETY: the network is alive and exclusively borrowed; `options`, `entries`
            // (with the names they point to), the cache bytes and `callback` all outlive the
            // call, which is synchronous; the out pointers are valid.
            unsafe {
                sys::celer_trt_network_build(
                    self.raw.as_ptr(),
                    &options,
                    entries.as_ptr(),
                    entries.len(),
                    &mut plan,
                    &mut timing_cache,
                )
            },
            "buildSerializedNetwork",
        )?;
        // SAFETY: both are blobs returned by the call above (or null), each taken once.
        let plan = unsafe { take_blob(plan) }.ok_or_else(|| null_from("buildSerializedNetwork"))?;
        // SAFETY: as above.
        let timing_cache = unsafe { take_blob(timing_cache) };
        Ok(BuiltEngine { plan, timing_cache })
    }
}

/// Copies a shim blob into a Vec and destroys it.
///
/// # Safety
/// `blob` is null or a blob from the shim that nobody else will use or destroy.
unsafe fn take_blob(blob: *mut sys::celer_trt_blob) -> Option<Vec<u8>> {
    if blob.is_null() {
        return None;
    }
    // SAFETY: `blob` is a live blob (contract); data/size describe its bytes.
    let bytes = unsafe {
        let data = sys::celer_trt_blob_data(blob).cast::<u8>();
        let size = sys::celer_trt_blob_size(blob);
        if data.is_null() || size == 0 {
            Vec::new()
        } else {
            std::slice::from_raw_parts(data, size).to_vec()
        }
    };
    // SAFETY: destroyed once, after the copy.
    unsafe { sys::celer_trt_blob_destroy(blob) };
    Some(bytes)
}

/// IProgressMonitor's calls, forwarded to the Rust callback given to `build`.
extern "C" fn progress_trampoline(
    user: *mut c_void,
    event: i32,
    phase: *const c_char,
    parent: *const c_char,
    step: i32,
    nb_steps: i32,
) -> i32 {
    // A panic must not unwind into TensorRT; the build goes on without the report.
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // SAFETY: `user` points to the `&dyn Fn` that `build` keeps alive across the
        // synchronous build call, the only time TensorRT calls the monitor.
        let callback = unsafe { *user.cast::<&(dyn Fn(BuildProgress<'_>) + Sync)>() };
        // SAFETY: TensorRT passes NUL-terminated names (or null) valid during the call.
        let (phase, parent) = unsafe { (result::string_at(phase), result::string_at(parent)) };
        let event = match event as u32 {
            sys::CELER_TRT_PHASE_START => BuildProgress::PhaseStart {
                phase: &phase,
                parent: (!parent.is_empty()).then_some(parent.as_str()),
                steps: nb_steps,
            },
            sys::CELER_TRT_PHASE_STEP => BuildProgress::Step {
                phase: &phase,
                step,
            },
            _ => BuildProgress::PhaseFinish { phase: &phase },
        };
        callback(event);
    }));
    1
}
