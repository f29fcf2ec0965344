//! What one HBONE connection may hold of its Pods' bytes on their way to a peer: read from the
//! Pods' sockets, not yet written to the peer's. HTTP/2 bounds each stream's queue (`h2`'s send
//! buffer), not the connection's, and a peer that grants window but never reads would have every
//! stream's queue filled: 200 streams of 4 MiB each. Reading from a Pod takes from this budget
//! first; writing to the peer gives back. A Pod whose connection is at it waits, as it would for a
//! slow reader over plain TCP.
//!
//! A stream whose peer grants no window holds what it read until the peer does; so that a few such
//! streams cannot take the whole budget from the others, a read takes at most a fair part of it,
//! shared among the streams reading.
use std::{
    io,
    pin::Pin,
    sync::{
        Arc, Mutex, PoisonError,
        atomic::{AtomicUsize, Ordering},
    },
    task::{Context, Poll, Waker},
};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf, Take};

/// The least and the most one read of a Pod may take.
const MIN_SHARE: usize = 16 * 1024;
const MAX_SHARE: usize = 1024 * 1024;

/// The budget of one connection.
#[derive(Debug)]
pub(super) struct SendBudget {
    limit: usize,
    queued: AtomicUsize,
    /// The Pods' readers, waiting or not.
    readers: AtomicUsize,
    /// The Pods' readers waiting for room.
    waiting: Mutex<Vec<Waker>>,
}

impl SendBudget {
    pub(super) fn new(limit: usize) -> Arc<Self> {
        Arc::new(SendBudget {
            limit,
            queued: AtomicUsize::new(0),
            readers: AtomicUsize::new(0),
            waiting: Mutex::default(),
        })
    }

    /// The most one read may take: half the budget shared among the readers, between a TLS record
    /// and the relay's largest read.
    fn share(&self) -> usize {
        let readers = self.readers.load(Ordering::Acquire).max(1);
        (self.limit / readers.saturating_mul(2)).clamp(MIN_SHARE, MAX_SHARE)
    }

    /// Takes up to `want` bytes of room; 0 when there is none.
    fn reserve(&self, want: usize) -> usize {
        let taken = self
            .queued
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |queued| {
                let room = self.limit.saturating_sub(queued);
                (room > 0).then(|| queued + room.min(want))
            });
        match taken {
            Ok(before) => self.limit.saturating_sub(before).min(want),
            Err(_) => 0,
        }
    }

    /// Gives back room taken and not used, or written out to the peer.
    fn release(&self, n: usize) {
        if n == 0 {
            return;
        }
        // Frame headers and control frames are written too: never below nothing.
        let _ = self
            .queued
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |queued| {
                Some(queued.saturating_sub(n))
            });
        let waiting = std::mem::take(&mut *self.lock());
        waiting.into_iter().for_each(Waker::wake);
    }

    fn wait(&self, waker: &Waker) {
        let mut waiting = self.lock();
        if !waiting.iter().any(|w| w.will_wake(waker)) {
            waiting.push(waker.clone());
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Waker>> {
        self.waiting.lock().unwrap_or_else(PoisonError::into_inner)
    }

    #[cfg(test)]
    pub(super) fn queued(&self) -> usize {
        self.queued.load(Ordering::Acquire)
    }
}

/// A Pod's reading half, reading only what its connection's budget has room for.
pub(super) struct Gated<R> {
    inner: Take<R>,
    budget: Arc<SendBudget>,
}

impl<R: AsyncRead + Unpin> Gated<R> {
    pub(super) fn new(inner: R, budget: Arc<SendBudget>) -> Self {
        budget.readers.fetch_add(1, Ordering::AcqRel);
        Gated {
            inner: inner.take(0),
            budget,
        }
    }
}

impl<R> Drop for Gated<R> {
    fn drop(&mut self) {
        self.budget.readers.fetch_sub(1, Ordering::AcqRel);
    }
}

impl<R: AsyncRead + Unpin> AsyncRead for Gated<R> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let want = buf.remaining().min(this.budget.share());
        if want == 0 {
            return Poll::Ready(Ok(()));
        }
        let mut room = this.budget.reserve(want);
        if room == 0 {
            this.budget.wait(cx.waker());
            // Room given back between the two looks would otherwise wake no one.
            room = this.budget.reserve(want);
            if room == 0 {
                return Poll::Pending;
            }
        }
        // A limit of 0 would read as the end of the stream: `room` is at least 1 here.
        this.inner.set_limit(room as u64);
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.inner).poll_read(cx, buf);
        let read = match polled {
            Poll::Ready(Ok(())) => buf.filled().len() - before,
            Poll::Ready(Err(_)) | Poll::Pending => 0,
        };
        this.budget.release(room - read);
        polled
    }
}

/// The connection to the peer, giving back to the budget what is written to it.
pub(super) struct Metered<T> {
    inner: T,
    budget: Arc<SendBudget>,
}

impl<T> Metered<T> {
    pub(super) fn new(inner: T, budget: Arc<SendBudget>) -> Self {
        Metered { inner, budget }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Metered<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Metered<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let written = Pin::new(&mut this.inner).poll_write(cx, data);
        if let Poll::Ready(Ok(n)) = written {
            this.budget.release(n);
        }
        written
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let written = Pin::new(&mut this.inner).poll_write_vectored(cx, data);
        if let Poll::Ready(Ok(n)) = written {
            this.budget.release(n);
        }
        written
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    #[tokio::test]
    async fn pods_read_no_more_than_the_budget_until_the_peer_takes_some() {
        // Smaller than a read's least part: reads are held by the room left alone.
        let budget = SendBudget::new(1000);
        let (mut pod_a, a) = tokio::io::duplex(1 << 16);
        let (mut pod_b, b) = tokio::io::duplex(1 << 16);
        pod_a.write_all(&[1; 4000]).await.unwrap();
        pod_b.write_all(&[2; 4000]).await.unwrap();
        let mut a = Gated::new(a, budget.clone());
        let mut b = Gated::new(b, budget.clone());
        let mut buf = vec![0; 4000];
        assert_eq!(a.read(&mut buf[..600]).await.unwrap(), 600);
        assert_eq!(b.read(&mut buf).await.unwrap(), 400);
        assert_eq!(budget.queued(), 1000);
        // Both wait; a write to the peer gives room back and wakes them.
        let waiting = tokio::spawn(async move {
            let mut buf = vec![0; 4000];
            a.read(&mut buf).await.unwrap()
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiting.is_finished());
        let (peer, _far) = tokio::io::duplex(1 << 16);
        let mut peer = Metered::new(peer, budget.clone());
        peer.write_all(&[0; 300]).await.unwrap();
        let read = tokio::time::timeout(Duration::from_secs(1), waiting)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(read, 300);
        assert_eq!(budget.queued(), 1000);
    }

    #[tokio::test]
    async fn one_read_takes_a_part_of_the_budget_that_shrinks_as_readers_come() {
        let budget = SendBudget::new(16 << 20);
        let (mut pod, a) = tokio::io::duplex(4 << 20);
        pod.write_all(&vec![1; 3 << 20]).await.unwrap();
        let mut a = Gated::new(a, budget.clone());
        let mut buf = vec![0; 2 << 20];
        assert_eq!(a.read(&mut buf).await.unwrap(), MAX_SHARE);
        let others: Vec<_> = (0..63)
            .map(|_| Gated::new(tokio::io::empty(), budget.clone()))
            .collect();
        assert_eq!(a.read(&mut buf).await.unwrap(), 128 * 1024);
        drop(others);
        assert_eq!(a.read(&mut buf).await.unwrap(), MAX_SHARE);
    }

    #[tokio::test]
    async fn the_end_of_a_pods_stream_is_read_as_such() {
        let budget = SendBudget::new(10);
        let (pod, a) = tokio::io::duplex(64);
        drop(pod);
        let mut a = Gated::new(a, budget.clone());
        assert_eq!(a.read(&mut [0; 64]).await.unwrap(), 0);
        assert_eq!(budget.queued(), 0);
    }
}
