//! The answers queued for one agent's Report stream: its own acks and the
//! lease grants and releases the hub sends it, read by the stream's
//! response body (`agent_wire`).
//!
//! A server keeps one such queue per connected node for as long as the node
//! lives, so its idle size counts ten thousand times: tokio's bounded
//! channel pads its state to cache lines and allocates its slots 32 at a
//! time (~1.1 KiB a stream, idle). This one is a short deque under a lock
//! and a semaphore of free slots (~0.2 KiB). It is bounded like the
//! channel: a sender waits for a free slot (`send`) or is refused
//! (`try_send`), so an agent that stops reading its acks stops being read.
//!
//! Lease messages are never dropped (`send_lease`): an end the agent never
//! hears leaves a process pinned to CPUs granted to someone else. They
//! queue beyond the slots, up to [`MAX_LEASE_BACKLOG`]; past that the
//! stream is ended (ABORTED) so the agent registers again and hears, from
//! the reconciliation, every lease that ended meanwhile.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, Waker};

use fairplace_proto::v1 as pb;
use tokio::sync::Semaphore;
use tonic::Status;

/// One answer on an agent's Report stream: an Ack, or the status the stream
/// ends with. Both are boxed: an `Ack` (leases, rejection) is over a hundred
/// bytes, and the queue's slots are as large as their largest item.
pub type AckItem = Result<Box<pb::Ack>, Box<Status>>;

/// The stream's response went away: nothing sent now is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Closed;

struct Shared {
    state: Mutex<State>,
    /// Free slots: a sender takes one before it queues, the reader gives it
    /// back. Closed when the reader goes.
    space: Semaphore,
}

/// Lease messages queued beyond the slots at most, before the stream is
/// ended so its agent registers again.
pub const MAX_LEASE_BACKLOG: usize = 4096;

struct State {
    /// Each item, and whether it holds a slot (lease messages beyond the
    /// slots hold none).
    items: VecDeque<(AckItem, bool)>,
    /// Lease messages queued beyond the slots.
    backlog: usize,
    /// The stream was ended for a backlog too long: nothing more queues.
    ended: bool,
    /// The reader, waiting for an item or for the last sender to go.
    reader: Option<Waker>,
    senders: usize,
}

/// A queue of at most `capacity` answers.
pub fn ack_queue(capacity: usize) -> (AckTx, AckRx) {
    let shared = Arc::new(Shared {
        state: Mutex::new(State {
            items: VecDeque::new(),
            backlog: 0,
            ended: false,
            reader: None,
            senders: 1,
        }),
        space: Semaphore::new(capacity),
    });
    (AckTx(Arc::clone(&shared)), AckRx(shared))
}

fn lock(s: &Shared) -> MutexGuard<'_, State> {
    s.state.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The sending side; clones share the queue.
pub struct AckTx(Arc<Shared>);

impl AckTx {
    /// Queues `item`, waiting for a free slot.
    pub async fn send(&self, item: AckItem) -> Result<(), Closed> {
        let permit = self.0.space.acquire().await.map_err(|_| Closed)?;
        permit.forget();
        self.push(item);
        Ok(())
    }

    /// Queues `item` if a slot is free now.
    pub fn try_send(&self, item: AckItem) -> Result<(), Closed> {
        let permit = self.0.space.try_acquire().map_err(|_| Closed)?;
        permit.forget();
        self.push(item);
        Ok(())
    }

    /// Queues a lease message: in a free slot, or beyond the slots; a
    /// backlog past [`MAX_LEASE_BACKLOG`] ends the stream instead.
    pub fn send_lease(&self, item: AckItem) -> Result<(), Closed> {
        if self.0.space.is_closed() {
            return Err(Closed);
        }
        if let Ok(permit) = self.0.space.try_acquire() {
            permit.forget();
            self.push(item);
            return Ok(());
        }
        let reader = {
            let mut s = lock(&self.0);
            if s.ended {
                return Err(Closed);
            }
            if s.backlog >= MAX_LEASE_BACKLOG {
                s.ended = true;
                let end = Status::aborted(
                    "lease messages backed up: register again to hear every lease that ended",
                );
                s.items.push_back((Err(Box::new(end)), false));
            } else {
                s.backlog += 1;
                s.items.push_back((item, false));
            }
            s.reader.take()
        };
        if let Some(w) = reader {
            w.wake();
        }
        Ok(())
    }

    fn push(&self, item: AckItem) {
        let reader = {
            let mut s = lock(&self.0);
            if s.ended {
                // Ended for a backlog: the permit goes back, nothing more
                // is read.
                drop(s);
                self.0.space.add_permits(1);
                return;
            }
            s.items.push_back((item, true));
            s.reader.take()
        };
        if let Some(w) = reader {
            w.wake();
        }
    }
}

impl Clone for AckTx {
    fn clone(&self) -> Self {
        lock(&self.0).senders += 1;
        Self(Arc::clone(&self.0))
    }
}

impl Drop for AckTx {
    fn drop(&mut self) {
        let reader = {
            let mut s = lock(&self.0);
            s.senders -= 1;
            if s.senders == 0 {
                s.reader.take()
            } else {
                None
            }
        };
        if let Some(w) = reader {
            w.wake();
        }
    }
}

/// The reading side: the stream's response body.
pub struct AckRx(Arc<Shared>);

impl AckRx {
    /// The next answer; `None` once it is empty and every sender is gone.
    pub fn poll_recv(&mut self, cx: &mut Context<'_>) -> Poll<Option<AckItem>> {
        let mut s = lock(&self.0);
        if let Some((item, slot)) = s.items.pop_front() {
            if !slot {
                s.backlog = s.backlog.saturating_sub(1);
            }
            drop(s);
            if slot {
                self.0.space.add_permits(1);
            }
            return Poll::Ready(Some(item));
        }
        if s.senders == 0 {
            return Poll::Ready(None);
        }
        if !s.reader.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
            s.reader = Some(cx.waker().clone());
        }
        Poll::Pending
    }

    /// The next answer (see `poll_recv`).
    #[cfg(test)]
    pub async fn recv(&mut self) -> Option<AckItem> {
        std::future::poll_fn(|cx| self.poll_recv(cx)).await
    }
}

impl Drop for AckRx {
    fn drop(&mut self) {
        self.0.space.close();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn ack(seq: u64) -> AckItem {
        Ok(Box::new(pb::Ack {
            applied_seq: seq,
            ..Default::default()
        }))
    }

    fn seq(item: Option<AckItem>) -> u64 {
        item.expect("an item").expect("an ack").applied_seq
    }

    #[tokio::test]
    async fn items_arrive_in_order_and_the_end_comes_when_every_sender_is_gone() {
        let (tx, mut rx) = ack_queue(4);
        let tx2 = tx.clone();
        tx.send(ack(1)).await.unwrap();
        tx2.try_send(ack(2)).unwrap();
        drop(tx);
        assert_eq!(seq(rx.recv().await), 1);
        assert_eq!(seq(rx.recv().await), 2);
        let waiting = tokio::spawn(async move { rx.recv().await.is_none() });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiting.is_finished(), "a sender is left");
        drop(tx2);
        assert!(waiting.await.unwrap());
    }

    #[tokio::test]
    async fn a_full_queue_refuses_try_send_and_holds_send_until_a_slot_frees() {
        let (tx, mut rx) = ack_queue(2);
        tx.send(ack(1)).await.unwrap();
        tx.send(ack(2)).await.unwrap();
        assert_eq!(tx.try_send(ack(9)), Err(Closed));
        let tx2 = tx.clone();
        let blocked = tokio::spawn(async move { tx2.send(ack(3)).await });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!blocked.is_finished(), "no slot is free");
        assert_eq!(seq(rx.recv().await), 1);
        blocked.await.unwrap().unwrap();
        assert_eq!(seq(rx.recv().await), 2);
        assert_eq!(seq(rx.recv().await), 3);
    }

    /// A lease message is never dropped for a full queue: it queues beyond
    /// the slots, in order, and the slots it did not take stay free.
    #[tokio::test]
    async fn lease_messages_queue_beyond_a_full_queue_in_order() {
        let (tx, mut rx) = ack_queue(1);
        tx.send(ack(1)).await.unwrap();
        assert_eq!(tx.try_send(ack(9)), Err(Closed), "the one slot is taken");
        tx.send_lease(ack(2)).unwrap();
        tx.send_lease(ack(3)).unwrap();
        assert_eq!(seq(rx.recv().await), 1);
        assert_eq!(seq(rx.recv().await), 2);
        assert_eq!(seq(rx.recv().await), 3);
        // Only the slot taken by `send` came back: one free slot.
        tx.try_send(ack(4)).unwrap();
        assert_eq!(tx.try_send(ack(5)), Err(Closed));
        assert_eq!(seq(rx.recv().await), 4);
    }

    /// Past the backlog the stream ends (ABORTED) rather than grow, and
    /// nothing queues after the end.
    #[tokio::test]
    async fn a_lease_backlog_past_its_bound_ends_the_stream() {
        let (tx, mut rx) = ack_queue(1);
        tx.send(ack(0)).await.unwrap();
        for i in 0..=MAX_LEASE_BACKLOG as u64 {
            tx.send_lease(ack(i + 1)).unwrap();
        }
        assert_eq!(tx.send_lease(ack(9)), Err(Closed));
        let mut last = None;
        for _ in 0..=MAX_LEASE_BACKLOG + 1 {
            last = rx.recv().await;
        }
        let end = last.expect("an item").expect_err("the end");
        assert_eq!(end.code(), tonic::Code::Aborted);
    }

    #[tokio::test]
    async fn senders_fail_once_the_reader_is_gone_even_those_already_waiting() {
        let (tx, rx) = ack_queue(1);
        tx.send(ack(1)).await.unwrap();
        let tx2 = tx.clone();
        let blocked = tokio::spawn(async move { tx2.send(ack(2)).await });
        tokio::time::sleep(Duration::from_millis(20)).await;
        drop(rx);
        assert_eq!(blocked.await.unwrap(), Err(Closed));
        assert_eq!(tx.send(ack(3)).await, Err(Closed));
        assert_eq!(tx.try_send(ack(4)), Err(Closed));
    }

    #[test]
    fn an_idle_queue_is_small() {
        // The point of this type (module doc): well under tokio's channel.
        assert!(
            std::mem::size_of::<Shared>() <= 160,
            "{}",
            std::mem::size_of::<Shared>()
        );
    }
}
