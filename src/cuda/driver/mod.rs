//! celer's own layer over the CUDA driver API, in three layers as cudarc's: `sys` (each
//! entry point celer calls, resolved by name with a raw integer `CUresult`), `result`
//! (`DriverError`: the raw code and the call, and whether the context is lost; the table
//! of codes celer knows), and the safe types the rest of celer uses: the primary context
//! (`CudaContext`) and a context of celer's own (`OwnContext`), streams, device buffers
//! and views, events, modules and kernels, launches, page-locked host memory. Plus `counters()`: what celer asked the driver for.
//!
//! Why not cudarc's own: cudarc resolves every entry point as returning its `CUresult`
//! enum, and a driver newer than the bindings returns codes the enum lacks (Hopper's
//! `CUDA_ERROR_CONTAINED`, and any later one): a Rust enum holding such a value is
//! undefined behaviour. Here no code the driver returns or writes is ever an enum. cudarc
//! remains for its loader (`culib`, which finds the stand-in driver as the real one) and
//! its type definitions. There is no cross-stream event tracking: each of celer's buffers
//! lives on one stream. `Drop` never panics: a failed release is logged and counted
//! (`CudaContext::release_failures`).

mod context;
mod counters;
mod event;
mod launch;
mod memory;
mod module;
mod own_context;
mod queued;
pub mod result;
mod stream;
pub mod sys;

pub use context::{
    current, device_count, driver_version, init, set_current, CudaContext, Device,
    PrimaryContextState,
};
pub use counters::{counters, DriverCounters};
pub use event::CudaEvent;
pub use launch::{LaunchArgs, LaunchConfig, PushKernelArg};
pub use memory::{
    CudaSlice, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, DeviceRepr, PinnedHostSlice,
    ValidAsZeroBits,
};
pub use module::{CudaFunction, CudaModule};
pub use own_context::OwnContext;
pub use result::{code, DriverError};
pub use stream::CudaStream;
