//! Loading TensorRT and running engines: the opened libraries (`TensorRt`), the runtime of
//! one CUDA context, engines shared by `Arc`, and one `ExecutionContext` per replica.
//! Ownership mirrors TensorRT's lifetime rules: a context holds its engine, an engine its
//! runtime, and everything the libraries, so drops always happen child first; and each of
//! them is made and destroyed with its CUDA context current (`CudaContextScope`, given by
//! the context's owner), on whichever thread drops it last. CUDA streams and device memory
//! come from the caller (the cuda module); this module never allocates device memory or
//! synchronises a stream.

use std::ffi::{c_void, OsString};
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use super::result::{self, check};
use super::sys;
use super::types::{
    CudaContextScope, CudaStream, DevicePtr, InputProfile, LibraryPaths, TensorDesc, TrtError,
    TrtVersion,
};

/// The TensorRT version of the headers the shim was compiled against. `Option` so
/// that callers read the same with or without the `tensorrt` feature.
pub fn compiled_version() -> Option<TrtVersion> {
    // SAFETY: returns a constant; no preconditions.
    Some(TrtVersion::from_encoded(unsafe {
        sys::celer_trt_compiled_version()
    }))
}

/// Where the libraries are looked for: defined here, beside the only code that opens them,
/// because the default names follow the compiled version.
impl LibraryPaths {
    /// `CELER_NVINFER_PATH` / `CELER_NVONNXPARSER_PATH`, else the sonames of the major
    /// version the shim was compiled for (`libnvinfer.so.10`, `libnvonnxparser.so.10`).
    pub fn from_env() -> Self {
        Self::with_env(|key| std::env::var_os(key))
    }

    /// As `from_env`, reading variables through `var` (for tests).
    pub fn with_env(var: impl Fn(&str) -> Option<OsString>) -> Self {
        let suffix = compiled_version()
            .map(|v| format!(".{}", v.major))
            .unwrap_or_default();
        let pick = |key: &str, library: &str| {
            var(key).filter(|v| !v.is_empty()).map_or_else(
                || PathBuf::from(format!("{library}{suffix}")),
                PathBuf::from,
            )
        };
        Self {
            nvinfer: pick("CELER_NVINFER_PATH", "libnvinfer.so"),
            nvonnxparser: pick("CELER_NVONNXPARSER_PATH", "libnvonnxparser.so"),
        }
    }
}

/// The opened libraries. Closing them comes last: every other handle keeps an `Arc`.
pub(super) struct Library {
    pub(super) raw: NonNull<sys::celer_trt_library>,
    version: TrtVersion,
    file: PathBuf,
    pub(super) has_parser: bool,
}

// SAFETY: The shim's library object is immutable after `celer_trt_library_open(_parser)`
// (both done before it is shared) and holds process-wide dlopen handles, usable from
// any thread.
unsafe impl Send for Library {}
// SAFETY: As for Send; shared access only reads it.
unsafe impl Sync for Library {}

impl Drop for Library {
    fn drop(&mut self) {
        // SAFETY: `raw` came from celer_trt_library_open and is closed once; every
        // object created from it holds an Arc<Library> and so is already gone.
        unsafe { sys::celer_trt_library_close(self.raw.as_ptr()) }
    }
}

/// TensorRT, loaded. Cheap to clone.
#[derive(Clone)]
pub struct TensorRt {
    lib: Arc<Library>,
}

impl std::fmt::Debug for TensorRt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TensorRt")
            .field("version", &self.lib.version)
            .field("file", &self.lib.file)
            .finish()
    }
}

impl TensorRt {
    /// The headers' version (see [`compiled_version`]).
    pub fn compiled_version() -> Option<TrtVersion> {
        compiled_version()
    }

    /// The ONNX parser interface version of the headers (NV_ONNX_PARSER_VERSION); a
    /// parser library must have its major and at least its minor.
    pub fn compiled_parser_version() -> Option<TrtVersion> {
        // SAFETY: returns a constant; no preconditions.
        Some(TrtVersion::from_encoded(unsafe {
            sys::celer_trt_compiled_parser_version()
        }))
    }

    /// libnvinfer only, for running engines ([`LibraryPaths::from_env`]).
    pub fn load_runtime() -> Result<Self, TrtError> {
        Self::load(&LibraryPaths::from_env(), false)
    }

    /// libnvinfer and libnvonnxparser, for building engines.
    pub fn load_builder() -> Result<Self, TrtError> {
        Self::load(&LibraryPaths::from_env(), true)
    }

    /// Opens libnvinfer (and the ONNX parser if `with_parser`), refusing a library whose
    /// major version differs from the headers' or whose minor is older.
    pub fn load(paths: &LibraryPaths, with_parser: bool) -> Result<Self, TrtError> {
        let nvinfer = result::path_arg(&paths.nvinfer)?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: `nvinfer` is NUL-terminated and outlives the call; `log_message` is
        // an extern "C" fn that never unwinds; `raw` is a valid out pointer.
        let status = unsafe {
            sys::celer_trt_library_open(nvinfer.as_ptr(), Some(result::log_message), &mut raw)
        };
        check(status, "celer_trt_library_open")
            .map_err(|e| library_error(e, "CELER_NVINFER_PATH"))?;
        let raw = NonNull::new(raw)
            .ok_or_else(|| TrtError::Library("the shim returned no library".into()))?;
        // SAFETY: `raw` is the open library.
        let (version, file) = unsafe {
            (
                TrtVersion::from_encoded(sys::celer_trt_library_version(raw.as_ptr())),
                PathBuf::from(result::string_at(sys::celer_trt_library_resolved_path(
                    raw.as_ptr(),
                ))),
            )
        };
        let mut lib = Library {
            raw,
            version,
            file,
            has_parser: false,
        };
        if with_parser {
            let parser = result::path_arg(&paths.nvonnxparser)?;
            // SAFETY: `lib.raw` is open and not yet shared; `parser` outlives the call.
            let status =
                unsafe { sys::celer_trt_library_open_parser(lib.raw.as_ptr(), parser.as_ptr()) };
            check(status, "celer_trt_library_open_parser")
                .map_err(|e| library_error(e, "CELER_NVONNXPARSER_PATH"))?;
            lib.has_parser = true;
        }
        tracing::info!(version = %lib.version, library = %lib.file.display(), "TensorRT loaded");
        Ok(Self { lib: Arc::new(lib) })
    }

    /// The loaded library's version.
    pub fn version(&self) -> TrtVersion {
        self.lib.version
    }

    /// The file the dynamic loader resolved libnvinfer to.
    pub fn library_file(&self) -> &Path {
        &self.lib.file
    }

    /// A runtime for engines of one CUDA context (`context`: its owner's scope), which it
    /// deserialises into; it, its engines and their execution contexts are made and
    /// destroyed with that context current.
    pub fn runtime(&self, context: Arc<dyn CudaContextScope>) -> Result<Runtime, TrtError> {
        let mut raw = std::ptr::null_mut();
        in_context(&*context, "createInferRuntime", || {
            check(
                // SAFETY: the library is open (we hold it); `raw` is a valid out pointer.
                unsafe { sys::celer_trt_runtime_create(self.lib.raw.as_ptr(), &mut raw) },
                "createInferRuntime",
            )
        })?;
        let raw = NonNull::new(raw).ok_or_else(|| null_from("createInferRuntime"))?;
        Ok(Runtime {
            inner: Arc::new(RuntimeInner {
                raw,
                deserialize: Mutex::new(()),
                context,
                _lib: self.lib.clone(),
            }),
        })
    }

    pub(super) fn library(&self) -> &Arc<Library> {
        &self.lib
    }
}

/// Adds what to do to a failure to open a library.
fn library_error(e: TrtError, variable: &str) -> TrtError {
    let major = compiled_version().map_or(0, |v| v.major);
    match e {
        TrtError::LibraryNotFound(message) => TrtError::LibraryNotFound(format!(
            "{message}. Install TensorRT {major}.x and put its lib directory on LD_LIBRARY_PATH, \
             or set {variable} to the library file"
        )),
        TrtError::Call { message, .. } => TrtError::Library(message),
        other => other,
    }
}

pub(super) fn null_from(call: &'static str) -> TrtError {
    TrtError::Call {
        call,
        message: "returned no object".into(),
    }
}

/// Runs `body` (a shim call and its `check`, which must stay on this thread) with
/// `context` current.
fn in_context<T>(
    context: &dyn CudaContextScope,
    call: &'static str,
    body: impl FnOnce() -> Result<T, TrtError>,
) -> Result<T, TrtError> {
    let mut body = Some(body);
    let mut result = None;
    context
        .with_current(&mut || result = body.take().map(|b| b()))
        .map_err(|why| TrtError::Call {
            call,
            message: format!("cannot make the engine's CUDA context current: {why}"),
        })?;
    result.unwrap_or_else(|| {
        Err(TrtError::Call {
            call,
            message: "the CUDA context's scope did not run the call".into(),
        })
    })
}

/// Destroys a TensorRT object (`what`, for the log) with `context` current, as TensorRT
/// frees its device memory through the current context. When the context cannot be made
/// current (it is held by `context`, so only a reset could have destroyed it) the object
/// is destroyed anyway, with an error logged: it must go before its parent.
fn destroy_in(context: &dyn CudaContextScope, what: &'static str, destroy: impl FnOnce()) {
    let mut destroy = Some(destroy);
    let bound = context.with_current(&mut || {
        if let Some(d) = destroy.take() {
            d();
        }
    });
    if let Err(why) = bound {
        tracing::error!(target: "tensorrt", object = what, reason = %why,
            "destroying a TensorRT object without its CUDA context current");
    }
    if let Some(d) = destroy.take() {
        d();
    }
}

struct RuntimeInner {
    raw: NonNull<sys::celer_trt_runtime>,
    /// Serialises deserialisation: TensorRT documents the runtime's thread safety per
    /// execution context, not for concurrent deserializeCudaEngine calls.
    deserialize: Mutex<()>,
    /// The CUDA context its engines live in.
    context: Arc<dyn CudaContextScope>,
    _lib: Arc<Library>,
}

// SAFETY: TensorRT objects are not bound to the thread that created them; the only call
// into the IRuntime (`deserialize`) is serialised by the mutex, and engines keep the
// runtime alive only through this Arc.
unsafe impl Send for RuntimeInner {}
// SAFETY: As for Send.
unsafe impl Sync for RuntimeInner {}

impl Drop for RuntimeInner {
    fn drop(&mut self) {
        let raw = self.raw;
        // SAFETY: created by celer_trt_runtime_create; every engine holds an Arc to this,
        // so none is left (TensorRT's rule: the runtime outlives its engines).
        destroy_in(&*self.context, "IRuntime", || unsafe {
            sys::celer_trt_runtime_destroy(raw.as_ptr())
        });
    }
}

/// A TensorRT runtime: deserialises plans into engines. Cheap to clone.
#[derive(Clone)]
pub struct Runtime {
    inner: Arc<RuntimeInner>,
}

impl Runtime {
    /// Deserialises a plan into the runtime's CUDA context (made current for the call: the
    /// weights are copied to its device).
    pub fn deserialize(&self, plan: &[u8]) -> Result<Arc<Engine>, TrtError> {
        let mut raw = std::ptr::null_mut();
        {
            let _one_at_a_time = self
                .inner
                .deserialize
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            in_context(&*self.inner.context, "deserializeCudaEngine", || {
                check(
                    // SAFETY: the runtime is alive; `plan` is readable for `plan.len()`
                    // bytes during the call (TensorRT copies what it keeps); `raw` is a
                    // valid out pointer.
                    unsafe {
                        sys::celer_trt_engine_deserialize(
                            self.inner.raw.as_ptr(),
                            plan.as_ptr().cast::<c_void>(),
                            plan.len(),
                            &mut raw,
                        )
                    },
                    "deserializeCudaEngine",
                )
            })?;
        }
        let raw = NonNull::new(raw).ok_or_else(|| null_from("deserializeCudaEngine"))?;
        let mut engine = Engine {
            raw,
            io: Vec::new(),
            calls: Mutex::new(()),
            context: self.inner.context.clone(),
            _runtime: self.inner.clone(),
        };
        engine.io = engine.read_io()?;
        Ok(Arc::new(engine))
    }
}

/// A deserialised engine, shared by `Arc` between the execution contexts of a device.
pub struct Engine {
    raw: NonNull<sys::celer_trt_engine>,
    io: Vec<TensorDesc>,
    /// Serialises calls into the ICudaEngine (context creation, queries): TensorRT does
    /// not document them as safe to make concurrently.
    calls: Mutex<()>,
    /// The CUDA context it was deserialised in, current when it or a context of it is
    /// made or destroyed.
    context: Arc<dyn CudaContextScope>,
    _runtime: Arc<RuntimeInner>,
}

// SAFETY: TensorRT objects are not thread-affine, and every call into the ICudaEngine
// goes through `calls`; execution contexts, the part TensorRT says must not be shared
// between threads, are separate objects (`ExecutionContext`, not Sync).
unsafe impl Send for Engine {}
// SAFETY: As for Send: shared access either reads Rust-side copies (`io`) or takes
// the `calls` lock.
unsafe impl Sync for Engine {}

impl Drop for Engine {
    fn drop(&mut self) {
        let raw = self.raw;
        // SAFETY: created by celer_trt_engine_deserialize; every context holds an
        // Arc<Engine>, so none is left. The runtime (`_runtime`) is dropped after this.
        destroy_in(&*self.context, "ICudaEngine", || unsafe {
            sys::celer_trt_engine_destroy(raw.as_ptr())
        });
    }
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine").field("io", &self.io).finish()
    }
}

impl Engine {
    fn lock(&self) -> std::sync::MutexGuard<'_, ()> {
        self.calls.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn read_io(&self) -> Result<Vec<TensorDesc>, TrtError> {
        let _guard = self.lock();
        let mut count = 0;
        check(
            // SAFETY: the engine is alive; `count` is a valid out pointer.
            unsafe { sys::celer_trt_engine_io_count(self.raw.as_ptr(), &mut count) },
            "getNbIOTensors",
        )?;
        let mut io = Vec::with_capacity(count.max(0) as usize);
        for index in 0..count {
            // SAFETY: all-zero is a valid celer_trt_tensor_desc (null name, zero dims).
            let mut desc: sys::celer_trt_tensor_desc = unsafe { std::mem::zeroed() };
            check(
                // SAFETY: the engine is alive; `desc` is a valid out pointer.
                unsafe { sys::celer_trt_engine_io_tensor(self.raw.as_ptr(), index, &mut desc) },
                "getIOTensorName",
            )?;
            // SAFETY: the name is owned by the engine, alive during this copy.
            io.push(unsafe { result::tensor_desc(&desc) });
        }
        Ok(io)
    }

    /// Every input and output, in TensorRT's order.
    pub fn io_tensors(&self) -> &[TensorDesc] {
        &self.io
    }

    pub fn inputs(&self) -> impl Iterator<Item = &TensorDesc> {
        self.io.iter().filter(|t| t.is_input)
    }

    pub fn outputs(&self) -> impl Iterator<Item = &TensorDesc> {
        self.io.iter().filter(|t| !t.is_input)
    }

    pub fn profile_count(&self) -> Result<usize, TrtError> {
        let _guard = self.lock();
        let mut count = 0;
        check(
            // SAFETY: the engine is alive; `count` is a valid out pointer.
            unsafe { sys::celer_trt_engine_profile_count(self.raw.as_ptr(), &mut count) },
            "getNbOptimizationProfiles",
        )?;
        Ok(count.max(0) as usize)
    }

    /// The min / opt / max shapes of input `name` in optimisation profile `index`.
    pub fn profile(&self, name: &str, index: usize) -> Result<InputProfile, TrtError> {
        let c_name = result::c_name(name)?;
        let empty = result::dims_from(&[])?;
        let (mut min, mut opt, mut max) = (empty, empty, empty);
        let _guard = self.lock();
        check(
            // SAFETY: the engine is alive; `c_name` outlives the call; the dims are valid
            // out pointers.
            unsafe {
                sys::celer_trt_engine_profile_shape(
                    self.raw.as_ptr(),
                    c_name.as_ptr(),
                    i32::try_from(index).unwrap_or(i32::MAX),
                    &mut min,
                    &mut opt,
                    &mut max,
                )
            },
            "getProfileShape",
        )?;
        Ok(InputProfile {
            name: name.to_string(),
            min: result::dims_to_vec(&min),
            opt: result::dims_to_vec(&opt),
            max: result::dims_to_vec(&max),
        })
    }

    /// Device memory one execution context needs for activations, bytes.
    pub fn device_memory_bytes(&self) -> Result<u64, TrtError> {
        let _guard = self.lock();
        let mut bytes = 0i64;
        check(
            // SAFETY: the engine is alive; `bytes` is a valid out pointer.
            unsafe { sys::celer_trt_engine_device_memory_size(self.raw.as_ptr(), &mut bytes) },
            "getDeviceMemorySize",
        )?;
        Ok(bytes.max(0) as u64)
    }

    /// A context whose activation memory TensorRT allocates on the current device.
    pub fn create_context(self: &Arc<Self>) -> Result<ExecutionContext, TrtError> {
        self.new_context(false)
    }

    /// A context that runs in `bytes` of caller-owned device memory at `memory` (at
    /// least [`Engine::device_memory_bytes`]).
    ///
    /// # Safety
    /// `memory` must stay allocated, and be used by nothing else while work is in flight
    /// on this context, until the context is dropped.
    pub unsafe fn create_context_with_memory(
        self: &Arc<Self>,
        memory: DevicePtr,
        bytes: u64,
    ) -> Result<ExecutionContext, TrtError> {
        let needed = self.device_memory_bytes()?;
        if bytes < needed {
            return Err(TrtError::InvalidArgument(format!(
                "the engine needs {needed} bytes of device memory per context, {bytes} given"
            )));
        }
        let context = self.new_context(true)?;
        check(
            // SAFETY: the context is alive and exclusively ours; the memory contract is the
            // caller's.
            unsafe {
                sys::celer_trt_context_set_device_memory(
                    context.raw.as_ptr(),
                    memory.as_raw(),
                    i64::try_from(bytes).unwrap_or(i64::MAX),
                )
            },
            "setDeviceMemory",
        )?;
        Ok(context)
    }

    fn new_context(
        self: &Arc<Self>,
        user_managed_memory: bool,
    ) -> Result<ExecutionContext, TrtError> {
        let mut raw = std::ptr::null_mut();
        {
            let _guard = self.lock();
            in_context(&*self.context, "createExecutionContext", || {
                check(
                    // SAFETY: the engine is alive; `raw` is a valid out pointer.
                    unsafe {
                        sys::celer_trt_context_create(
                            self.raw.as_ptr(),
                            i32::from(user_managed_memory),
                            &mut raw,
                        )
                    },
                    "createExecutionContext",
                )
            })?;
        }
        let raw = NonNull::new(raw).ok_or_else(|| null_from("createExecutionContext"))?;
        Ok(ExecutionContext {
            raw,
            engine: self.clone(),
        })
    }
}

/// One replica's execution context: its own activation memory and shapes; work is
/// enqueued on the replica's own stream. Send (it moves to the replica's thread) but not
/// Sync: TensorRT forbids using one context from two threads at once.
pub struct ExecutionContext {
    raw: NonNull<sys::celer_trt_context>,
    engine: Arc<Engine>,
}

// SAFETY: TensorRT allows a context to be used from any thread as long as no two use it
// at once ("the runtime can be used by multiple threads simultaneously, so long as each
// object uses a different execution context"); without Sync, and with every mutating
// call on `&mut self`, Rust enforces exactly that.
unsafe impl Send for ExecutionContext {}

impl Drop for ExecutionContext {
    fn drop(&mut self) {
        // Destroying a context touches its engine; serialised like every engine call.
        let _guard = self.engine.lock();
        let raw = self.raw;
        // SAFETY: created by celer_trt_context_create and destroyed once, before the
        // engine (`engine` field, dropped after this).
        destroy_in(&*self.engine.context, "IExecutionContext", || unsafe {
            sys::celer_trt_context_destroy(raw.as_ptr())
        });
    }
}

impl ExecutionContext {
    pub fn engine(&self) -> &Arc<Engine> {
        &self.engine
    }

    /// Selects optimisation profile `index` (asynchronously on `stream`).
    pub fn set_optimization_profile(
        &mut self,
        index: usize,
        stream: CudaStream,
    ) -> Result<(), TrtError> {
        // SAFETY: the context is alive and exclusively borrowed; the stream's validity is
        // the contract of `CudaStream::from_raw`.
        check(
            unsafe {
                sys::celer_trt_context_set_optimization_profile(
                    self.raw.as_ptr(),
                    i32::try_from(index).unwrap_or(i32::MAX),
                    stream.as_raw(),
                )
            },
            "setOptimizationProfileAsync",
        )
    }

    /// Sets the shape of a dynamic input for the next enqueue.
    pub fn set_input_shape(&mut self, name: &str, shape: &[i64]) -> Result<(), TrtError> {
        let c_name = result::c_name(name)?;
        let dims = result::dims_from(shape)?;
        // SAFETY: the context is alive and exclusively borrowed; `c_name` and `dims`
        // outlive the call.
        check(
            unsafe {
                sys::celer_trt_context_set_input_shape(self.raw.as_ptr(), c_name.as_ptr(), &dims)
            },
            "setInputShape",
        )
    }

    /// The shape of tensor `name` given the input shapes set so far.
    pub fn tensor_shape(&self, name: &str) -> Result<Vec<i64>, TrtError> {
        let c_name = result::c_name(name)?;
        let mut dims = result::dims_from(&[])?;
        check(
            // SAFETY: the context is alive (shared borrow, and the type is not Sync, so no
            // other thread uses it); `c_name` and `dims` outlive the call.
            unsafe {
                sys::celer_trt_context_tensor_shape(self.raw.as_ptr(), c_name.as_ptr(), &mut dims)
            },
            "getTensorShape",
        )?;
        Ok(result::dims_to_vec(&dims))
    }

    /// Binds tensor `name` to device memory at `address` for the next enqueue.
    ///
    /// # Safety
    /// `address` must hold at least the tensor's size in bytes (its shape times its
    /// element size) and stay allocated until the work enqueued with it has completed.
    pub unsafe fn set_tensor_address(
        &mut self,
        name: &str,
        address: DevicePtr,
    ) -> Result<(), TrtError> {
        let c_name = result::c_name(name)?;
        // SAFETY: the context is alive and exclusively borrowed; the address contract is
        // the caller's.
        check(
            unsafe {
                sys::celer_trt_context_set_tensor_address(
                    self.raw.as_ptr(),
                    c_name.as_ptr(),
                    address.as_raw(),
                )
            },
            "setTensorAddress",
        )
    }

    /// Enqueues the engine on `stream` (enqueueV3). Returns once the work is queued.
    ///
    /// # Safety
    /// Every I/O tensor must be bound to valid device memory (see `set_tensor_address`)
    /// and every dynamic input shape set. The caller must synchronise `stream` before it
    /// reads the outputs, rebinds or frees the buffers, or drops this context or its
    /// engine.
    pub unsafe fn enqueue(&mut self, stream: CudaStream) -> Result<(), TrtError> {
        // SAFETY: the context is alive and exclusively borrowed; buffers and stream are
        // the caller's contract.
        check(
            unsafe { sys::celer_trt_context_enqueue(self.raw.as_ptr(), stream.as_raw()) },
            "enqueueV3",
        )
    }
}
