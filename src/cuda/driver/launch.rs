//! Kernel launches: a `LaunchConfig` (grid, block, dynamic shared memory) and the
//! arguments pushed one by one (`CudaStream::launch_builder`, `PushKernelArg::arg`), as
//! cudarc's builder takes them: scalars by reference, device buffers as their addresses.

use std::ffi::c_void;
use std::marker::PhantomData;

use super::counters::{count, LIVE};
use super::memory::{CudaSlice, CudaView, CudaViewMut, DeviceRepr};
use super::module::CudaFunction;
use super::result::DriverError;
use super::stream::CudaStream;
use super::sys;

/// A launch's shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchConfig {
    /// (x, y, z) blocks in the grid.
    pub grid_dim: (u32, u32, u32),
    /// (x, y, z) threads in a block.
    pub block_dim: (u32, u32, u32),
    /// Dynamic shared memory per block, in bytes.
    pub shared_mem_bytes: u32,
}

impl LaunchConfig {
    /// A 1-D launch of `n` threads in blocks of 1024.
    pub fn for_num_elems(n: u32) -> Self {
        Self {
            grid_dim: (n.div_ceil(1024), 1, 1),
            block_dim: (1024, 1, 1),
            shared_mem_bytes: 0,
        }
    }
}

/// A launch being put together: the kernel, its stream and the addresses of its
/// arguments (`kernelParams`: a pointer to each argument's value), each borrowed for as
/// long as the builder lives.
#[derive(Debug)]
pub struct LaunchArgs<'a> {
    stream: &'a CudaStream,
    function: &'a CudaFunction,
    args: Vec<*mut c_void>,
    marker: PhantomData<&'a ()>,
}

impl CudaStream {
    /// A launch of `function` on this stream; push its arguments in the kernel's order.
    pub fn launch_builder<'a>(&'a self, function: &'a CudaFunction) -> LaunchArgs<'a> {
        LaunchArgs {
            stream: self,
            function,
            args: Vec::new(),
            marker: PhantomData,
        }
    }
}

/// Pushes one kernel argument.
///
/// # Safety
/// An implementation pushes the address of a value of the kernel parameter's C type that
/// lives as long as the builder (`'a`).
pub unsafe trait PushKernelArg<T> {
    fn arg(&mut self, arg: T) -> &mut Self;
}

// SAFETY: a scalar's own address; `'b: 'a` keeps it alive for the builder.
unsafe impl<'a, 'b: 'a, T: DeviceRepr> PushKernelArg<&'b T> for LaunchArgs<'a> {
    fn arg(&mut self, arg: &'b T) -> &mut Self {
        self.args
            .push((arg as *const T).cast_mut().cast::<c_void>());
        self
    }
}

// SAFETY: the address of the buffer's device pointer (the kernel's `T*` parameter),
// borrowed for the builder's life.
unsafe impl<'a, 'b: 'a, T> PushKernelArg<&'b CudaSlice<T>> for LaunchArgs<'a> {
    fn arg(&mut self, arg: &'b CudaSlice<T>) -> &mut Self {
        self.args.push(
            (&arg.ptr as *const sys::CUdeviceptr)
                .cast_mut()
                .cast::<c_void>(),
        );
        self
    }
}

// SAFETY: as for `&CudaSlice`; the kernel may write the buffer, which is borrowed mutably.
unsafe impl<'a, 'b: 'a, T> PushKernelArg<&'b mut CudaSlice<T>> for LaunchArgs<'a> {
    fn arg(&mut self, arg: &'b mut CudaSlice<T>) -> &mut Self {
        self.args.push(
            (&arg.ptr as *const sys::CUdeviceptr)
                .cast_mut()
                .cast::<c_void>(),
        );
        self
    }
}

// SAFETY: the address of the view's device pointer, borrowed for the builder's life.
unsafe impl<'a, 'b: 'a, 'c: 'b, T> PushKernelArg<&'b CudaView<'c, T>> for LaunchArgs<'a> {
    fn arg(&mut self, arg: &'b CudaView<'c, T>) -> &mut Self {
        self.args.push(
            (&arg.ptr as *const sys::CUdeviceptr)
                .cast_mut()
                .cast::<c_void>(),
        );
        self
    }
}

// SAFETY: as for `&CudaView`; the view is borrowed mutably.
unsafe impl<'a, 'b: 'a, 'c: 'b, T> PushKernelArg<&'b mut CudaViewMut<'c, T>> for LaunchArgs<'a> {
    fn arg(&mut self, arg: &'b mut CudaViewMut<'c, T>) -> &mut Self {
        self.args.push(
            (&arg.ptr as *const sys::CUdeviceptr)
                .cast_mut()
                .cast::<c_void>(),
        );
        self
    }
}

impl LaunchArgs<'_> {
    /// Queues the launch (`cuLaunchKernel`).
    ///
    /// # Safety
    /// The arguments pushed must match the kernel's parameters in number, order and type,
    /// and every buffer must hold all that the kernel touches for `cfg`.
    pub unsafe fn launch(&mut self, cfg: LaunchConfig) -> Result<(), DriverError> {
        self.stream.context().bind_to_thread()?;
        count(&LIVE.launches);
        let (gx, gy, gz) = cfg.grid_dim;
        let (bx, by, bz) = cfg.block_dim;
        // SAFETY: forwarded to the caller (the arguments); each pointer in `args` points
        // at a value borrowed for the builder's life; no `extra`.
        unsafe {
            sys::cuLaunchKernel(
                self.function.cu_function(),
                gx,
                gy,
                gz,
                bx,
                by,
                bz,
                cfg.shared_mem_bytes,
                self.stream.cu_stream(),
                self.args.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
    }
}
