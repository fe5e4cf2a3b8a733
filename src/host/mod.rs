//! The machine celer runs on: the cores this process may use (affinity and cgroup
//! quota), where the Python wheels put the native libraries it loads, and writing a file
//! whole or not at all. The ground floor: it imports nothing of celer's.

pub mod atomic_write;
pub mod cpus;
pub mod priority;
pub mod wheels;
pub mod work_pool;
