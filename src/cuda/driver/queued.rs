//! Memory work queued on a stream: device allocations (in stream order where the device
//! has memory pools), memsets, and copies between host and device and on the device.
//! Everything is asynchronous except what CUDA documents otherwise (a download into
//! pageable host memory is complete when the call returns); a copy larger than its
//! destination is refused before the driver is called.

use std::ffi::c_void;
use std::marker::PhantomData;
use std::sync::Arc;

use super::counters::{count_bytes, LIVE};
use super::memory::{CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr, ValidAsZeroBits};
use super::result::DriverError;
use super::stream::CudaStream;
use super::sys::{self, CUdeviceptr};

/// Refuses a copy of `from` elements into room for `into`.
fn fits(call: &'static str, from: usize, into: usize) -> Result<(), DriverError> {
    if from > into {
        return Err(DriverError::refused(
            call,
            format!("{from} elements do not fit the {into} of the destination"),
        ));
    }
    Ok(())
}

impl CudaStream {
    /// `len` elements of device memory, in this stream's order.
    ///
    /// # Safety
    /// The memory is not initialised: nothing may read it before something writes it.
    pub unsafe fn alloc<T: DeviceRepr>(
        self: &Arc<Self>,
        len: usize,
    ) -> Result<CudaSlice<T>, DriverError> {
        let call = if self.context().has_memory_pools() {
            "cuMemAllocAsync"
        } else {
            "cuMemAlloc_v2"
        };
        let bytes = len
            .checked_mul(std::mem::size_of::<T>())
            .ok_or_else(|| DriverError::refused(call, format!("{len} elements overflow")))?;
        self.context().bind_to_thread()?;
        let mut ptr: CUdeviceptr = 0;
        let answer = if self.context().has_memory_pools() {
            // SAFETY: the out-pointer is valid for one write; the stream is live.
            unsafe { sys::cuMemAllocAsync(&mut ptr, bytes, self.cu_stream()) }
        } else {
            // SAFETY: the out-pointer is valid for one write.
            unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes) }
        };
        answer.result()?;
        Ok(CudaSlice {
            ptr,
            len,
            stream: self.clone(),
            marker: PhantomData,
        })
    }

    /// `len` zeroed elements of device memory (allocated, then zeroed, in stream order).
    pub fn alloc_zeros<T: DeviceRepr + ValidAsZeroBits>(
        self: &Arc<Self>,
        len: usize,
    ) -> Result<CudaSlice<T>, DriverError> {
        // SAFETY: zeroed below, in stream order, before anything queued later reads it.
        let mut slice = unsafe { self.alloc::<T>(len) }?;
        self.memset_zeros(&mut slice)?;
        Ok(slice)
    }

    /// Zeroes `dst` (`cuMemsetD8Async`).
    pub fn memset_zeros<T: ValidAsZeroBits>(
        &self,
        dst: &mut impl DevicePtrMut<T>,
    ) -> Result<(), DriverError> {
        let bytes = dst.num_bytes();
        self.context().bind_to_thread()?;
        count_bytes(&LIVE.memsets, &LIVE.memset_bytes, bytes);
        // SAFETY: `dst` is `bytes` bytes of live device memory, written in stream order.
        unsafe { sys::cuMemsetD8Async(dst.device_ptr(), 0, bytes, self.cu_stream()) }.result()
    }

    /// Queues the copy of `src` into the start of `dst` (`cuMemcpyHtoDAsync_v2`). From
    /// page-locked memory the copy reads `src` when the stream gets to it: the caller keeps
    /// it unchanged until then. From pageable memory the driver stages it first.
    pub fn memcpy_htod<T: DeviceRepr>(
        &self,
        src: &(impl AsRef<[T]> + ?Sized),
        dst: &mut impl DevicePtrMut<T>,
    ) -> Result<(), DriverError> {
        let src = src.as_ref();
        fits("cuMemcpyHtoDAsync_v2", src.len(), dst.len())?;
        let bytes = std::mem::size_of_val(src);
        self.context().bind_to_thread()?;
        count_bytes(&LIVE.htod_copies, &LIVE.htod_bytes, bytes);
        // SAFETY: `src` is `bytes` bytes of host memory, `dst` at least as many of live
        // device memory (checked above); the caller keeps page-locked `src` as it is until
        // the stream ran the copy (the method's contract, as CUDA's).
        unsafe {
            sys::cuMemcpyHtoDAsync_v2(
                dst.device_ptr(),
                src.as_ptr().cast::<c_void>(),
                bytes,
                self.cu_stream(),
            )
        }
        .result()
    }

    /// Queues the copy of `src` into the start of `dst` (`cuMemcpyDtoHAsync_v2`). Into
    /// page-locked memory it lands when the stream gets to it (synchronise before reading);
    /// into pageable memory it is complete when this returns, as CUDA documents.
    pub fn memcpy_dtoh<T: DeviceRepr>(
        &self,
        src: &impl DevicePtr<T>,
        dst: &mut (impl AsMut<[T]> + ?Sized),
    ) -> Result<(), DriverError> {
        let dst = dst.as_mut();
        fits("cuMemcpyDtoHAsync_v2", src.len(), dst.len())?;
        // SAFETY: `dst` has room for `src`'s bytes (checked above) and is borrowed mutably
        // for the call. A page-locked `dst` is written later, in stream order: the caller
        // reads it after synchronising.
        unsafe { self.download_into(dst.as_mut_ptr().cast::<c_void>(), src) }
    }

    /// Queues the copy of all of `src` to host memory at `dst` (`cuMemcpyDtoHAsync_v2`),
    /// counted.
    ///
    /// # Safety
    /// `dst` must be valid for `src.num_bytes()` bytes of writes until the copy is done
    /// (when this returns, for pageable memory; in stream order for page-locked memory).
    unsafe fn download_into<T>(
        &self,
        dst: *mut c_void,
        src: &impl DevicePtr<T>,
    ) -> Result<(), DriverError> {
        let bytes = src.num_bytes();
        self.context().bind_to_thread()?;
        count_bytes(&LIVE.dtoh_copies, &LIVE.dtoh_bytes, bytes);
        // SAFETY: forwarded to the caller for `dst`; `src` is `bytes` bytes of live device
        // memory.
        unsafe { sys::cuMemcpyDtoHAsync_v2(dst, src.device_ptr(), bytes, self.cu_stream()) }
            .result()
    }

    /// Queues the copy of `src` into the start of `dst` on the device
    /// (`cuMemcpyDtoDAsync_v2`).
    pub fn memcpy_dtod<T>(
        &self,
        src: &impl DevicePtr<T>,
        dst: &mut impl DevicePtrMut<T>,
    ) -> Result<(), DriverError> {
        fits("cuMemcpyDtoDAsync_v2", src.len(), dst.len())?;
        let bytes = src.num_bytes();
        self.context().bind_to_thread()?;
        count_bytes(&LIVE.dtod_copies, &LIVE.dtod_bytes, bytes);
        // SAFETY: both ranges are `bytes` bytes of live device memory (checked above).
        unsafe {
            sys::cuMemcpyDtoDAsync_v2(dst.device_ptr(), src.device_ptr(), bytes, self.cu_stream())
        }
        .result()
    }

    /// A new buffer holding `src` (allocated, then uploaded, in stream order).
    pub fn clone_htod<T: DeviceRepr>(
        self: &Arc<Self>,
        src: &(impl AsRef<[T]> + ?Sized),
    ) -> Result<CudaSlice<T>, DriverError> {
        let src = src.as_ref();
        // SAFETY: the upload below writes every element before anything queued later
        // reads one.
        let mut dst = unsafe { self.alloc::<T>(src.len()) }?;
        self.memcpy_htod(src, &mut dst)?;
        Ok(dst)
    }

    /// `src` downloaded into a new vector, once the stream has run everything queued
    /// before (a download into pageable memory completes before the call returns).
    pub fn clone_dtoh<T: DeviceRepr>(
        &self,
        src: &impl DevicePtr<T>,
    ) -> Result<Vec<T>, DriverError> {
        let len = src.len();
        let mut dst: Vec<T> = Vec::with_capacity(len);
        // SAFETY: the vector has room for `len` elements (`src.num_bytes()` bytes), and
        // it is pageable: the copy is done when this returns.
        unsafe { self.download_into(dst.as_mut_ptr().cast::<c_void>(), src) }?;
        // SAFETY: a fresh heap allocation is pageable memory, and CUDA completes a
        // download into pageable memory before the call returns: the `len` elements are
        // written, and a DeviceRepr is plain data for which any bytes are a value.
        unsafe { dst.set_len(len) };
        Ok(dst)
    }
}
