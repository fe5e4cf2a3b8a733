//! Limits on what a client may hold while it talks to `celer serve`: connections, time to
//! send a request head and a body, idle keep-alive time, the memory of bodies in transit,
//! and how much of an unread body the server reads and discards after answering early
//! (so that the client can read the answer). Flags or environment variables.

use std::time::Duration;

/// The same limits as durations, as the HTTP layer uses them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnLimits {
    pub max_connections: usize,
    pub header_timeout: Duration,
    pub body_timeout: Duration,
    pub body_idle_timeout: Duration,
    pub keep_alive_timeout: Duration,
    pub send_timeout: Duration,
    pub body_buffer_bytes: usize,
    pub linger_bytes: u64,
    pub linger: Duration,
}

impl Default for ConnLimits {
    fn default() -> Self {
        Self {
            max_connections: 1024,
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(30),
            body_idle_timeout: Duration::from_secs(5),
            keep_alive_timeout: Duration::from_secs(75),
            send_timeout: Duration::from_secs(30),
            body_buffer_bytes: 256 * 1024 * 1024,
            linger_bytes: 64 * 1024 * 1024,
            linger: Duration::from_secs(5),
        }
    }
}

/// The slowest upload rate a whole-body deadline allows for the largest body a hosting
/// mode takes (async and batch bodies of hundreds of MB come from S3 inside AWS).
const MIN_BODY_RATE_BYTES_PER_S: u64 = 1024 * 1024;

impl ConnLimits {
    /// The limits raised where they would refuse every body the hosting mode allows: the
    /// memory of bodies in transit holds at least one largest body (or each would be a
    /// 503), and the whole-body time allows the largest body at 1 MiB/s, within the
    /// request deadline. Never lowered: a limit set higher stays.
    pub fn fit_to_bodies(mut self, max_body_bytes: usize, deadline: Duration) -> Self {
        self.body_buffer_bytes = self.body_buffer_bytes.max(max_body_bytes);
        let upload = Duration::from_secs(max_body_bytes as u64 / MIN_BODY_RATE_BYTES_PER_S);
        self.body_timeout = self.body_timeout.max(upload.min(deadline));
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn large_bodies_of_a_hosting_mode_fit_the_connection_limits() {
        let defaults = ConnLimits::default();
        // Real-time bodies (6 MiB) change nothing.
        assert_eq!(
            defaults.fit_to_bodies(6 << 20, Duration::from_secs(60)),
            defaults
        );
        // An async body of 400 MiB: held in memory whole, and given 400 s to arrive.
        let fitted = defaults.fit_to_bodies(400 << 20, Duration::from_secs(3600));
        assert_eq!(fitted.body_buffer_bytes, 400 << 20);
        assert_eq!(fitted.body_timeout, Duration::from_secs(400));
        // Never past the request's deadline.
        let short = defaults.fit_to_bodies(400 << 20, Duration::from_secs(120));
        assert_eq!(short.body_timeout, Duration::from_secs(120));
    }
}
