//! Limits on what a client may hold while it talks to `celer serve`: connections, time to
//! send a request head and a body, idle keep-alive time, the memory of bodies in transit,
//! and how much of an unread body the server reads and discards after answering early
//! (so that the client can read the answer). Flags or environment variables.

use std::time::Duration;

use clap::Args;

/// `celer serve`'s connection and upload limits (flattened into `ServeArgs`).
#[derive(Debug, Clone, Args)]
pub struct ConnArgs {
    /// Open connections at once; at the cap the server stops accepting (the kernel's
    /// backlog holds new ones) until one closes.
    #[arg(long, env = "CELER_MAX_CONNECTIONS", default_value_t = 1024)]
    pub max_connections: usize,

    /// Milliseconds to receive a whole request head, from the connection's start or from
    /// the head's first byte; then the connection is closed.
    #[arg(long, env = "CELER_HEADER_TIMEOUT_MS", default_value_t = 10_000)]
    pub header_timeout_ms: u64,

    /// Milliseconds to receive a whole request body, from its head; then 408
    /// `body_timeout`. No inference slot is held while a body arrives.
    #[arg(long, env = "CELER_BODY_TIMEOUT_MS", default_value_t = 30_000)]
    pub body_timeout_ms: u64,

    /// Milliseconds a body may go without a byte arriving; then 408 `body_timeout`.
    #[arg(long, env = "CELER_BODY_IDLE_TIMEOUT_MS", default_value_t = 5_000)]
    pub body_idle_timeout_ms: u64,

    /// Milliseconds an idle keep-alive connection is kept open between requests (above
    /// the 60 s idle timeout of AWS load balancers, so that they close first).
    #[arg(long, env = "CELER_KEEP_ALIVE_TIMEOUT_MS", default_value_t = 75_000)]
    pub keep_alive_timeout_ms: u64,

    /// Milliseconds a response may wait for the client to read any of it (a client that
    /// stops reading cannot hold the connection); then the connection is closed.
    #[arg(long, env = "CELER_SEND_TIMEOUT_MS", default_value_t = 30_000)]
    pub send_timeout_ms: u64,

    /// Bytes of request bodies held in memory at once over every connection; a body that
    /// would go over is refused with 503 `overloaded`.
    #[arg(long, env = "CELER_BODY_BUFFER_BYTES", default_value_t = 256 * 1024 * 1024)]
    pub body_buffer_bytes: usize,

    /// After answering before a body was read (413, 415, 503, ...), the server reads and
    /// discards at most this many bytes of it, so that a client that sends its whole
    /// body before reading (Python's http.client, requests) reads the answer instead of
    /// a reset connection.
    #[arg(long, env = "CELER_LINGER_BYTES", default_value_t = 64 * 1024 * 1024)]
    pub linger_bytes: u64,

    /// ... and for at most this many milliseconds.
    #[arg(long, env = "CELER_LINGER_MS", default_value_t = 5_000)]
    pub linger_ms: u64,
}

impl Default for ConnArgs {
    fn default() -> Self {
        ConnLimits::default().into()
    }
}

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

impl From<ConnLimits> for ConnArgs {
    fn from(l: ConnLimits) -> Self {
        let ms = |d: Duration| d.as_millis() as u64;
        Self {
            max_connections: l.max_connections,
            header_timeout_ms: ms(l.header_timeout),
            body_timeout_ms: ms(l.body_timeout),
            body_idle_timeout_ms: ms(l.body_idle_timeout),
            keep_alive_timeout_ms: ms(l.keep_alive_timeout),
            send_timeout_ms: ms(l.send_timeout),
            body_buffer_bytes: l.body_buffer_bytes,
            linger_bytes: l.linger_bytes,
            linger_ms: ms(l.linger),
        }
    }
}

impl ConnArgs {
    pub fn limits(&self) -> ConnLimits {
        let ms = |v: u64| Duration::from_millis(v.max(1));
        ConnLimits {
            max_connections: self.max_connections.max(1),
            header_timeout: ms(self.header_timeout_ms),
            body_timeout: ms(self.body_timeout_ms),
            body_idle_timeout: ms(self.body_idle_timeout_ms),
            keep_alive_timeout: ms(self.keep_alive_timeout_ms),
            send_timeout: ms(self.send_timeout_ms),
            body_buffer_bytes: self.body_buffer_bytes.max(1),
            linger_bytes: self.linger_bytes,
            linger: Duration::from_millis(self.linger_ms),
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

    #[test]
    fn defaults_round_trip_through_the_flags() {
        assert_eq!(ConnArgs::default().limits(), ConnLimits::default());
    }
}
