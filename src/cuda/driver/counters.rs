//! What celer asked the driver for, counted process-wide: launches, copies and their
//! bytes, memsets, synchronisations, page-locked memory. On a real GPU, where the stand-in
//! driver's own counters do not exist, a check takes `counters()` before and after a
//! request and reads its copies and waits from the difference.
//!
//! These count calls made by celer through this layer, whatever the driver answered;
//! never what TensorRT (which carries its own CUDA runtime), or anything else in the
//! process, asks of the driver. Relaxed atomics: each field is exact, but a snapshot taken
//! while other threads call the driver need not be one instant's.

use std::sync::atomic::{AtomicU64, Ordering};

macro_rules! driver_counters {
    ($($(#[$doc:meta])* $field:ident,)*) => {
        /// A snapshot of the counters ([`counters`]); `after - before` is what happened
        /// between two.
        #[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
        pub struct DriverCounters {
            $($(#[$doc])* pub $field: u64,)*
        }

        /// The live counters.
        pub(crate) struct Live {
            $(pub(crate) $field: AtomicU64,)*
        }

        pub(crate) static LIVE: Live = Live {
            $($field: AtomicU64::new(0),)*
        };

        /// The counters now.
        pub fn counters() -> DriverCounters {
            DriverCounters {
                $($field: LIVE.$field.load(Ordering::Relaxed),)*
            }
        }

        impl DriverCounters {
            /// What happened since `earlier` (each field saturating at 0).
            pub fn since(&self, earlier: &DriverCounters) -> DriverCounters {
                DriverCounters {
                    $($field: self.$field.saturating_sub(earlier.$field),)*
                }
            }
        }
    };
}

driver_counters! {
    /// `cuLaunchKernel` calls.
    launches,
    /// `cuMemsetD8Async` calls (`alloc_zeros`, `memset_zeros`), and their bytes.
    memsets,
    memset_bytes,
    /// `cuMemcpyHtoDAsync_v2` calls, and their bytes.
    htod_copies,
    htod_bytes,
    /// `cuMemcpyDtoHAsync_v2` calls, and their bytes.
    dtoh_copies,
    dtoh_bytes,
    /// `cuMemcpyDtoDAsync_v2` calls, and their bytes.
    dtod_copies,
    dtod_bytes,
    /// `cuStreamSynchronize` calls.
    stream_syncs,
    /// `cuEventSynchronize` calls.
    event_syncs,
    /// `cuCtxSynchronize` calls.
    context_syncs,
    /// `cuMemHostRegister_v2` calls, and their bytes.
    host_registrations,
    host_registration_bytes,
    /// `cuMemHostAlloc` calls (page-locked allocations), and their bytes.
    pinned_allocs,
    pinned_alloc_bytes,
}

impl std::ops::Sub for DriverCounters {
    type Output = DriverCounters;

    /// [`DriverCounters::since`].
    fn sub(self, earlier: DriverCounters) -> DriverCounters {
        self.since(&earlier)
    }
}

/// Counts one call of `counter`.
pub(crate) fn count(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

/// Counts one call of `calls` moving `bytes` (`bytes_counter`).
pub(crate) fn count_bytes(calls: &AtomicU64, bytes_counter: &AtomicU64, bytes: usize) {
    calls.fetch_add(1, Ordering::Relaxed);
    bytes_counter.fetch_add(bytes as u64, Ordering::Relaxed);
}
