//! celer's stand-in `libnvonnxparser.so.<major>`, for the tests: the two entry points
//! celer's shim resolves, forwarding to the stand-in libnvinfer it is linked with (by
//! soname, as the real parser is), which holds the networks the parser fills.

#[cfg(celer_trt_standin)]
mod exports {
    use std::ffi::c_void;

    // Resolved at load time in the libnvinfer.so.<major> this library needs.
    extern "C" {
        fn celer_trt_standin_onnx_parser_version() -> i32;
        fn celer_trt_standin_create_onnx_parser(
            network: *mut c_void,
            logger: *mut c_void,
            version: i32,
        ) -> *mut c_void;
    }

    /// `getNvOnnxParserVersion`.
    #[no_mangle]
    pub extern "C" fn getNvOnnxParserVersion() -> i32 {
        // SAFETY: returns a constant of the stand-in libnvinfer.
        unsafe { celer_trt_standin_onnx_parser_version() }
    }

    /// `createNvOnnxParser_INTERNAL(INetworkDefinition*, ILogger*, NV_ONNX_PARSER_VERSION)`.
    ///
    /// # Safety
    /// `network` is an `INetworkDefinition*` and `logger` an `ILogger*` that outlives the
    /// parser (the stand-in checks the network is one of its own).
    #[no_mangle]
    pub unsafe extern "C" fn createNvOnnxParser_INTERNAL(
        network: *mut c_void,
        logger: *mut c_void,
        version: i32,
    ) -> *mut c_void {
        // SAFETY: forwarded.
        unsafe { celer_trt_standin_create_onnx_parser(network, logger, version) }
    }
}
