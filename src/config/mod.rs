//! The options of `celer serve`. This module validates; it never opens a model or a socket.

mod conn;
pub mod hosting;
mod serve;

pub use conn::{ConnArgs, ConnLimits};
pub use hosting::{HostingMode, HostingPlan};
pub use serve::{DeviceArgs, RequestLimits, RuntimeArgs, ServeArgs};
