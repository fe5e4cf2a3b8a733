//! celer's stand-in TensorRT, for the tests: a `libnvinfer.so.<major>` that celer's shim
//! loads exactly as it loads the real library (dlopen, then the exported factories), built
//! against the same fetched TensorRT headers. Its C++ half (cpp/) implements the interfaces
//! the shim calls (runtime, engine, execution context, builder, builder config, network,
//! tensors, optimisation profiles, timing cache, ONNX parser, progress monitor, logger
//! callbacks) and enforces the rules the headers document; anything else aborts naming the
//! method. Engines run with ONNX Runtime (`model`) on the stand-in CUDA driver's device
//! memory, queued on the caller's stream.
//!
//! What a test can set (environment):
//! - `CELER_TRT_STANDIN_VERSION=10.17.0`: the TensorRT version the library reports (its
//!   headers' by default), to play an upgrade; plans record the version that built them.
//! - `CELER_TRT_STANDIN_FAULT_FILE=PATH`: when that file exists and holds `deserialize` or
//!   `enqueue`, that call fails (once; the file is removed); `enqueue-sticky`: the next
//!   enqueueV3 launches a kernel that hits an illegal address, so the engine's CUDA context
//!   becomes sticky (CUDA_ERROR_ILLEGAL_ADDRESS) and enqueueV3 fails, logging the error as
//!   TensorRT's CUDA runtime does.
//! - `CELER_TRT_STANDIN_ON_VIOLATION=log`: a broken lifetime rule is logged and counted
//!   instead of aborting (for the stand-in's own tests).
//! - `CELER_TRT_STANDIN_THREADS`: ONNX Runtime threads per engine (default 1).
//! - `CELER_TRT_STANDIN_BUILD_GATE=PATH`: an engine build waits until that file exists
//!   (at most ten minutes), as long as a test needs to serve while engines build.
//!
//! This crate is a cdylib for the tests to load; nothing links its rlib.

#[cfg(celer_trt_standin)]
mod model;

#[cfg(celer_trt_standin)]
mod exports {
    use std::ffi::c_void;

    extern "C" {
        fn standin_cpp_library_version() -> i32;
        fn standin_cpp_create_runtime(logger: *mut c_void, version: i32) -> *mut c_void;
        fn standin_cpp_create_builder(logger: *mut c_void, version: i32) -> *mut c_void;
        fn standin_cpp_create_parser(
            network: *mut c_void,
            logger: *mut c_void,
            version: i32,
        ) -> *mut c_void;
        fn standin_cpp_parser_version() -> i32;
        fn standin_cpp_violations() -> u64;
        fn standin_cpp_refusals() -> u64;
    }

    // The entry points of libnvinfer that celer's shim resolves with dlsym. Each forwards
    // to the C++ half, which never unwinds (every entry point catches).

    /// `getInferLibVersion`: the version this library plays.
    #[no_mangle]
    pub extern "C" fn getInferLibVersion() -> i32 {
        // SAFETY: reads a value computed once; no arguments.
        unsafe { standin_cpp_library_version() }
    }

    /// `createInferRuntime_INTERNAL(ILogger*, NV_TENSORRT_VERSION)`.
    ///
    /// # Safety
    /// `logger` is an `nvinfer1::ILogger*` that outlives the runtime.
    #[no_mangle]
    pub unsafe extern "C" fn createInferRuntime_INTERNAL(
        logger: *mut c_void,
        version: i32,
    ) -> *mut c_void {
        // SAFETY: forwarded; the C++ half only stores the logger.
        unsafe { standin_cpp_create_runtime(logger, version) }
    }

    /// `createInferBuilder_INTERNAL(ILogger*, NV_TENSORRT_VERSION)`.
    ///
    /// # Safety
    /// As for `createInferRuntime_INTERNAL`.
    #[no_mangle]
    pub unsafe extern "C" fn createInferBuilder_INTERNAL(
        logger: *mut c_void,
        version: i32,
    ) -> *mut c_void {
        // SAFETY: forwarded.
        unsafe { standin_cpp_create_builder(logger, version) }
    }

    /// What the stand-in libnvonnxparser's `createNvOnnxParser_INTERNAL` forwards to: the
    /// parser fills networks of this library, so it lives here.
    ///
    /// # Safety
    /// `network` is an `INetworkDefinition*` (checked to be one of this library's),
    /// `logger` an `ILogger*` outliving the parser.
    #[no_mangle]
    pub unsafe extern "C" fn celer_trt_standin_create_onnx_parser(
        network: *mut c_void,
        logger: *mut c_void,
        version: i32,
    ) -> *mut c_void {
        // SAFETY: forwarded; the C++ half checks the network against its live objects.
        unsafe { standin_cpp_create_parser(network, logger, version) }
    }

    /// The ONNX parser version of the headers (the stand-in libnvonnxparser reports it).
    #[no_mangle]
    pub extern "C" fn celer_trt_standin_onnx_parser_version() -> i32 {
        // SAFETY: a constant.
        unsafe { standin_cpp_parser_version() }
    }

    /// Lifetime rules broken so far (with CELER_TRT_STANDIN_ON_VIOLATION=log).
    #[no_mangle]
    pub extern "C" fn celer_trt_standin_violations() -> u64 {
        // SAFETY: reads an atomic.
        unsafe { standin_cpp_violations() }
    }

    /// Calls refused so far for breaking a documented rule.
    #[no_mangle]
    pub extern "C" fn celer_trt_standin_refusals() -> u64 {
        // SAFETY: reads an atomic.
        unsafe { standin_cpp_refusals() }
    }
}
