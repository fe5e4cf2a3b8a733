//! Raw bindings to the shim's C interface (`shim/celer_trt.h`): bindgen's output for the
//! project's own header, committed (sys_bindings.rs) so that a build needs no libclang;
//! build.rs refuses it once the header changes, and `make tensorrt-bindings` regenerates
//! it. Only `result`, `runtime` and `builder` use them.

#![allow(
    non_camel_case_types,
    non_upper_case_globals,
    non_snake_case,
    dead_code,
    clippy::all
)]

include!("sys_bindings.rs");
