//! One gRPC connection as tonic takes it: its socket, its place under the connection
//! cap, and what its calls share (`Conn`, the connect info tonic puts in each request):
//! the connection's own share of the calls in transit, and a kill switch that ends the
//! connection from outside hyper (a reader whose window stays closed holds its answers
//! in hyper's buffers, which only dropping the connection frees).

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::server::Connected;

/// What a connection's calls share (each request carries it as an extension).
#[derive(Clone)]
pub struct Conn(Arc<ConnShared>);

struct ConnShared {
    remote: Option<SocketAddr>,
    /// The calls this connection may have in transit at once.
    transit: Arc<Semaphore>,
    kill: KillSwitch,
}

impl Conn {
    fn new(remote: Option<SocketAddr>, share: usize) -> Self {
        Self(Arc::new(ConnShared {
            remote,
            transit: Arc::new(Semaphore::new(share.clamp(1, Semaphore::MAX_PERMITS))),
            kill: KillSwitch::default(),
        }))
    }

    pub fn remote(&self) -> Option<SocketAddr> {
        self.0.remote
    }

    /// A place in this connection's share of the calls in transit, if one is free.
    pub fn try_transit(&self) -> Option<OwnedSemaphorePermit> {
        self.0.transit.clone().try_acquire_owned().ok()
    }

    /// Ends the connection: its socket's next read or write fails, so hyper drops it
    /// with every stream and buffer it held.
    pub fn kill(&self) {
        self.0.kill.trip();
    }

    pub fn killed(&self) -> bool {
        self.0.kill.tripped()
    }
}

/// Set once; wakes the connection's task, which then finds its socket failing.
#[derive(Default)]
struct KillSwitch {
    tripped: AtomicBool,
    /// The waker of the task that last polled the socket (hyper's connection task).
    waker: Mutex<Option<Waker>>,
}

impl KillSwitch {
    fn trip(&self) {
        self.tripped.store(true, Ordering::Release);
        if let Some(waker) = self.waker.lock().ok().and_then(|mut w| w.take()) {
            waker.wake();
        }
    }

    fn tripped(&self) -> bool {
        self.tripped.load(Ordering::Acquire)
    }

    /// An error once tripped; else the task is kept to be woken by `trip`.
    fn check(&self, cx: &Context<'_>) -> io::Result<()> {
        if !self.tripped() {
            if let Ok(mut slot) = self.waker.lock() {
                match slot.as_ref() {
                    Some(w) if w.will_wake(cx.waker()) => {}
                    _ => *slot = Some(cx.waker().clone()),
                }
            }
            // Tripped between the check and the waker's keeping: `trip` found no waker.
            if !self.tripped() {
                return Ok(());
            }
        }
        Err(io::Error::new(
            io::ErrorKind::ConnectionAborted,
            "connection ended: an answer was not read within the send timeout",
        ))
    }
}

/// The accepted connections as tonic takes them, at most `max` open at once (each holds
/// a permit until its socket is dropped), each with `share` calls in transit of its own.
pub fn accept_capped(
    listener: TcpListener,
    max: usize,
    share: usize,
) -> ReceiverStream<io::Result<Capped>> {
    let permits = Arc::new(Semaphore::new(max.clamp(1, Semaphore::MAX_PERMITS)));
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    tokio::spawn(async move {
        loop {
            let permit = tokio::select! {
                p = permits.clone().acquire_owned() => match p {
                    Ok(p) => p,
                    Err(_) => return,
                },
                () = tx.closed() => return,
            };
            let accepted = tokio::select! {
                a = listener.accept() => a,
                () = tx.closed() => return,
            };
            match accepted {
                Ok((stream, remote)) => {
                    let _ = stream.set_nodelay(true);
                    let capped = Capped {
                        stream,
                        conn: Conn::new(Some(remote), share),
                        _permit: permit,
                    };
                    if tx.send(Ok(capped)).await.is_err() {
                        return;
                    }
                }
                Err(e) => {
                    // A reset before accept, or out of file descriptors: wait a little
                    // (the permit goes back) rather than spin.
                    tracing::warn!(error = %e, "gRPC accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    });
    ReceiverStream::new(rx)
}

/// A connection holding its place under the connection cap; its reads and writes fail
/// once its kill switch is tripped.
pub struct Capped {
    stream: TcpStream,
    conn: Conn,
    _permit: OwnedSemaphorePermit,
}

impl Connected for Capped {
    type ConnectInfo = Conn;

    fn connect_info(&self) -> Conn {
        self.conn.clone()
    }
}

impl AsyncRead for Capped {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        self.conn.0.kill.check(cx)?;
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for Capped {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.conn.0.kill.check(cx)?;
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.conn.0.kill.check(cx)?;
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.conn.0.kill.check(cx)?;
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tripped_switch_fails_the_socket_and_wakes_its_task() {
        let switch = KillSwitch::default();
        let woken = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        struct Count(Arc<std::sync::atomic::AtomicUsize>);
        impl std::task::Wake for Count {
            fn wake(self: Arc<Self>) {
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
        let waker = Waker::from(Arc::new(Count(woken.clone())));
        let cx = Context::from_waker(&waker);
        assert!(switch.check(&cx).is_ok());
        assert_eq!(woken.load(Ordering::SeqCst), 0);
        switch.trip();
        assert_eq!(woken.load(Ordering::SeqCst), 1, "the parked task is woken");
        let e = switch.check(&cx).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::ConnectionAborted);
    }

    #[test]
    fn a_connection_has_its_own_share() {
        let conn = Conn::new(None, 2);
        let held: Vec<_> = (0..2)
            .map(|_| conn.try_transit().expect("in share"))
            .collect();
        assert!(conn.try_transit().is_none(), "past the share");
        drop(held);
        assert!(conn.try_transit().is_some(), "freed places come back");
        assert!(Conn::new(None, 1).try_transit().is_some(), "each its own");
    }
}
