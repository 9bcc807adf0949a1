//! Loopback connections a reply can drop: [`Reply::disconnect`](super::Reply::disconnect)
//! closes its connection without writing a byte of a response, which axum's handlers
//! cannot do by themselves.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::extract::connect_info::Connected;
use axum::serve::IncomingStream;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};

/// Accepts loopback connections as [`Stream`]s that a reply can drop.
pub(super) struct Listener(pub(super) TcpListener);

/// The handle a request has on its connection (its connect info): [`Reply::disconnect`]
/// sets `killed`, and the connection's next read or write fails, so it closes without
/// writing a byte of the response.
#[derive(Debug, Clone, Default)]
pub(super) struct Connection {
    killed: Arc<AtomicBool>,
}

impl Connection {
    /// Drops the connection: its next read or write fails.
    pub(super) fn kill(&self) {
        self.killed.store(true, Ordering::Release);
    }
}

impl Connected<IncomingStream<'_, Listener>> for Connection {
    fn connect_info(stream: IncomingStream<'_, Listener>) -> Self {
        stream.remote_addr().clone()
    }
}

impl axum::serve::Listener for Listener {
    type Io = Stream;
    type Addr = Connection;

    async fn accept(&mut self) -> (Stream, Connection) {
        loop {
            match self.0.accept().await {
                Ok((tcp, _)) => {
                    // Answers are small single writes: never hold one back for an ACK.
                    let _ = tcp.set_nodelay(true);
                    let connection = Connection::default();
                    let killed = Arc::clone(&connection.killed);
                    return (Stream { tcp, killed }, connection);
                }
                // Such as running out of file descriptors: wait a little, as axum does.
                Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
            }
        }
    }

    fn local_addr(&self) -> io::Result<Connection> {
        // axum asks only to report it; a connection handle stands in for the address.
        Ok(Connection::default())
    }
}

/// A loopback connection that fails every read and write once its reply drops it.
pub(super) struct Stream {
    tcp: TcpStream,
    killed: Arc<AtomicBool>,
}

impl Stream {
    fn check(&self) -> io::Result<()> {
        if self.killed.load(Ordering::Acquire) {
            Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "the scripted reply drops the connection",
            ))
        } else {
            Ok(())
        }
    }
}

impl AsyncRead for Stream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        this.check()?;
        Pin::new(&mut this.tcp).poll_read(cx, buf)
    }
}

impl AsyncWrite for Stream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        this.check()?;
        Pin::new(&mut this.tcp).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        this.check()?;
        Pin::new(&mut this.tcp).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.tcp.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        this.check()?;
        Pin::new(&mut this.tcp).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().tcp).poll_shutdown(cx)
    }
}
