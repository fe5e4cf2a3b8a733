//! The bytes at either end of a request, the same for every device: `decode` (request
//! bytes to upright RGB8, limits checked from the header first), `render` (a device's
//! result as the body the output kind asks for) and `encode` (PNG, lossless WebP). They
//! run on the blocking pool, never on a replica's thread or the async executor.

pub mod decode;
pub mod encode;
pub mod render;

pub use encode::EncodeError;
pub use render::{planes_of, render, render_as, ImageFormat, RenderError, Rendered};
