//! Memory: device buffers (`CudaSlice<T>`, typed, with their length, freed on drop in
//! their stream's order), views of parts of them, and page-locked host buffers
//! (`PinnedHostSlice<T>`, from `cuMemHostAlloc`). No access is tracked across streams:
//! each of celer's buffers is used on the one stream that allocated it, and the owner of
//! a page-locked buffer synchronises its stream before reading what a copy wrote.

use std::ffi::c_void;
use std::marker::PhantomData;
use std::ops::{Bound, RangeBounds};
use std::sync::Arc;

use super::context::CudaContext;
use super::counters::{count_bytes, LIVE};
use super::result::DriverError;
use super::stream::CudaStream;
use super::sys::{self, CUdeviceptr};

/// A type that may be copied to the device and passed to a kernel by value: plain data
/// with the same layout in Rust and CUDA C.
///
/// # Safety
/// Implement only for types of a fixed C layout without pointers to host memory.
pub unsafe trait DeviceRepr: Copy {}

/// A type for which all-zero bytes are a valid value (`alloc_zeros`, `memset_zeros`).
///
/// # Safety
/// Every field must accept all-zero bits.
pub unsafe trait ValidAsZeroBits {}

macro_rules! plain {
    ($($t:ty),*) => {
        $(
            // SAFETY: a primitive of fixed layout, the same as its CUDA C counterpart.
            unsafe impl DeviceRepr for $t {}
            // SAFETY: all-zero bits are 0 (or 0.0, or false).
            unsafe impl ValidAsZeroBits for $t {}
        )*
    };
}

plain!(
    i8,
    i16,
    i32,
    i64,
    u8,
    u16,
    u32,
    u64,
    usize,
    isize,
    f32,
    f64,
    half::f16
);

/// Device memory that kernels and copies read: a buffer or a view of one.
pub trait DevicePtr<T> {
    /// Elements.
    fn len(&self) -> usize;

    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The device address of the first element.
    fn device_ptr(&self) -> CUdeviceptr;

    fn num_bytes(&self) -> usize {
        self.len() * std::mem::size_of::<T>()
    }
}

/// Device memory that kernels and copies may write: a buffer, or a mutable view of one.
pub trait DevicePtrMut<T>: DevicePtr<T> {}

/// `len` elements of `T` in device memory, allocated on a stream and freed on drop in
/// that stream's order (`cuMemFreeAsync` after everything queued on it so far), or, where
/// the device has no memory pools, once the stream has run (`cuMemFree_v2` after a
/// synchronisation).
#[derive(Debug)]
pub struct CudaSlice<T> {
    pub(crate) ptr: CUdeviceptr,
    pub(crate) len: usize,
    pub(crate) stream: Arc<CudaStream>,
    pub(crate) marker: PhantomData<*const T>,
}

// SAFETY: the buffer is device memory owned by this value alone; its address may be used
// from any thread (the stream binds its context first); `&self` only reads the address.
unsafe impl<T> Send for CudaSlice<T> {}
// SAFETY: as above.
unsafe impl<T> Sync for CudaSlice<T> {}

impl<T> Drop for CudaSlice<T> {
    fn drop(&mut self) {
        let stream = &self.stream;
        let context = stream.context();
        let freed = context.bind_to_thread().and_then(|()| {
            if context.has_memory_pools() {
                // SAFETY: the buffer was allocated on this stream and is not used after
                // this; the free runs after everything queued on the stream so far.
                unsafe { sys::cuMemFreeAsync(self.ptr, stream.cu_stream()) }.result()
            } else {
                // What is queued may still use it: wait, then free.
                stream.synchronize()?;
                // SAFETY: allocated by cuMemAlloc_v2, freed once, after its last use ran.
                unsafe { sys::cuMemFree_v2(self.ptr) }.result()
            }
        });
        context.record_release("a device buffer", freed);
    }
}

/// Start and end of `range` in a slice of `len`, when it lies inside.
fn bounds(range: impl RangeBounds<usize>, len: usize) -> Option<(usize, usize)> {
    let start = match range.start_bound() {
        Bound::Included(&n) => n,
        Bound::Excluded(&n) => n.checked_add(1)?,
        Bound::Unbounded => 0,
    };
    let end = match range.end_bound() {
        Bound::Included(&n) => n.checked_add(1)?,
        Bound::Excluded(&n) => n,
        Bound::Unbounded => len,
    };
    (start <= end && end <= len).then_some((start, end))
}

impl<T> CudaSlice<T> {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn num_bytes(&self) -> usize {
        self.len * std::mem::size_of::<T>()
    }

    /// The stream it was allocated on (and is freed on).
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        self.stream.context()
    }

    /// The device address of the first element, for a library that takes raw addresses
    /// (TensorRT's tensor bindings). Valid while `self` lives.
    pub fn device_ptr(&self) -> CUdeviceptr {
        self.ptr
    }

    fn view_of(&self, range: impl RangeBounds<usize>) -> Result<(CUdeviceptr, usize), DriverError> {
        let (start, end) = bounds(range, self.len).ok_or_else(|| {
            DriverError::refused(
                "a device view",
                format!("the range is outside the {} elements", self.len),
            )
        })?;
        let offset = (start * std::mem::size_of::<T>()) as CUdeviceptr;
        Ok((self.ptr + offset, end - start))
    }

    /// The elements of `range`, to read; an error (never a panic) when the range does not
    /// lie inside.
    pub fn slice(&self, range: impl RangeBounds<usize>) -> Result<CudaView<'_, T>, DriverError> {
        let (ptr, len) = self.view_of(range)?;
        Ok(CudaView {
            ptr,
            len,
            marker: PhantomData,
        })
    }

    /// The elements of `range`, to write; as [`CudaSlice::slice`].
    pub fn slice_mut(
        &mut self,
        range: impl RangeBounds<usize>,
    ) -> Result<CudaViewMut<'_, T>, DriverError> {
        let (ptr, len) = self.view_of(range)?;
        Ok(CudaViewMut {
            ptr,
            len,
            marker: PhantomData,
        })
    }
}

impl<T> DevicePtr<T> for CudaSlice<T> {
    fn len(&self) -> usize {
        self.len
    }

    fn device_ptr(&self) -> CUdeviceptr {
        self.ptr
    }
}

impl<T> DevicePtrMut<T> for CudaSlice<T> {}

/// Part of a [`CudaSlice`], read only.
#[derive(Debug, Clone, Copy)]
pub struct CudaView<'a, T> {
    pub(crate) ptr: CUdeviceptr,
    pub(crate) len: usize,
    marker: PhantomData<&'a CudaSlice<T>>,
}

impl<T> DevicePtr<T> for CudaView<'_, T> {
    fn len(&self) -> usize {
        self.len
    }

    fn device_ptr(&self) -> CUdeviceptr {
        self.ptr
    }
}

/// Part of a [`CudaSlice`], writable.
#[derive(Debug)]
pub struct CudaViewMut<'a, T> {
    pub(crate) ptr: CUdeviceptr,
    pub(crate) len: usize,
    marker: PhantomData<&'a mut CudaSlice<T>>,
}

impl<T> DevicePtr<T> for CudaViewMut<'_, T> {
    fn len(&self) -> usize {
        self.len
    }

    fn device_ptr(&self) -> CUdeviceptr {
        self.ptr
    }
}

impl<T> DevicePtrMut<T> for CudaViewMut<'_, T> {}

/// `len` elements of `T` in page-locked host memory (`cuMemHostAlloc`), zeroed when
/// made, freed with `cuMemFreeHost` on drop. Copies from and to it are DMA, asynchronous:
/// read what a download wrote only after synchronising its stream, and change what an
/// upload reads only after it ran.
#[derive(Debug)]
pub struct PinnedHostSlice<T> {
    ptr: *mut T,
    len: usize,
    context: Arc<CudaContext>,
}

// SAFETY: the memory is owned by this value alone; access goes through `&self` (shared
// reads) and `&mut self`, so Rust's borrow rules hold across threads.
unsafe impl<T: Send> Send for PinnedHostSlice<T> {}
// SAFETY: as above.
unsafe impl<T: Sync> Sync for PinnedHostSlice<T> {}

impl CudaContext {
    /// `len` zeroed elements of page-locked host memory (at least one), with
    /// `cuMemHostAlloc`'s `flags` (0, or `CU_MEMHOSTALLOC_WRITECOMBINED`: fast for the
    /// host to write and the GPU to read, very slow for the host to read).
    pub fn alloc_pinned<T: DeviceRepr + ValidAsZeroBits>(
        self: &Arc<Self>,
        len: usize,
        flags: u32,
    ) -> Result<PinnedHostSlice<T>, DriverError> {
        let len = len.max(1);
        let bytes = len
            .checked_mul(std::mem::size_of::<T>())
            .filter(|&b| b <= isize::MAX as usize)
            .ok_or_else(|| {
                DriverError::refused("cuMemHostAlloc", format!("{len} elements overflow"))
            })?;
        self.bind_to_thread()?;
        count_bytes(&LIVE.pinned_allocs, &LIVE.pinned_alloc_bytes, bytes);
        let mut ptr: *mut c_void = std::ptr::null_mut();
        // SAFETY: the out-pointer is valid for one write.
        unsafe { sys::cuMemHostAlloc(&mut ptr, bytes, flags) }.result()?;
        let slice = PinnedHostSlice {
            ptr: ptr.cast::<T>(),
            len,
            context: self.clone(),
        };
        if ptr.is_null() || !slice.ptr.is_aligned() {
            return Err(DriverError::refused(
                "cuMemHostAlloc",
                "the driver returned a null or misaligned pointer",
            ));
        }
        // SAFETY: `ptr` is valid for `bytes` bytes of writes (the driver's allocation), and
        // all-zero bits are a valid T, so every element is initialised from here.
        unsafe { std::ptr::write_bytes(slice.ptr, 0, len) };
        Ok(slice)
    }
}

impl<T> PinnedHostSlice<T> {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.context
    }

    /// The elements, as they are now: the owner synchronises the stream first if a copy
    /// into them may still be queued.
    pub fn as_slice(&self) -> &[T] {
        // SAFETY: `ptr` is valid for `len` initialised elements (zeroed when made) for as
        // long as `self` owns the allocation; `&self` allows only shared access.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The elements, to write: the owner makes sure no queued upload still reads them.
    pub fn as_mut_slice(&mut self) -> &mut [T] {
        // SAFETY: as `as_slice`; `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl<T> AsRef<[T]> for PinnedHostSlice<T> {
    fn as_ref(&self) -> &[T] {
        self.as_slice()
    }
}

impl<T> AsMut<[T]> for PinnedHostSlice<T> {
    fn as_mut(&mut self) -> &mut [T] {
        self.as_mut_slice()
    }
}

impl<T> Drop for PinnedHostSlice<T> {
    fn drop(&mut self) {
        let freed = self.context.bind_to_thread().and_then(|()| {
            // SAFETY: the allocation of cuMemHostAlloc, freed once; its owner let every
            // copy of it finish (the type's contract).
            unsafe { sys::cuMemFreeHost(self.ptr.cast::<c_void>()) }.result()
        });
        self.context
            .record_release("page-locked host memory", freed);
    }
}

#[cfg(test)]
mod tests {
    use std::ops::Bound;

    use super::bounds;

    #[test]
    fn views_lie_inside_their_buffer() {
        assert_eq!(bounds(.., 10), Some((0, 10)));
        assert_eq!(bounds(2..5, 10), Some((2, 5)));
        assert_eq!(bounds(..=9, 10), Some((0, 10)));
        assert_eq!(bounds(..11, 10), None);
        assert_eq!(bounds((Bound::Included(5), Bound::Excluded(2)), 10), None);
        assert_eq!(bounds(..=usize::MAX, 10), None);
    }
}
