//! Two-lane outgoing session streams: control messages (registration, heartbeats)
//! overtake whatever data (rule request batches, results) is queued behind them, so a
//! node with a large backlog of requests still tells FM it is alive on time.

use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::sync::mpsc;
use tokio_stream::Stream;

/// The sending side: [`Lanes::control`] for liveness and session protocol messages,
/// [`Lanes::data`] for everything else. Both are unbounded and never block.
#[derive(Debug)]
pub struct Lanes<T> {
    pub control: mpsc::UnboundedSender<T>,
    pub data: mpsc::UnboundedSender<T>,
}

impl<T> Clone for Lanes<T> {
    fn clone(&self) -> Self {
        Lanes {
            control: self.control.clone(),
            data: self.data.clone(),
        }
    }
}

/// The receiving side, a stream that always yields a queued control message before
/// any data message. It ends once both lanes are closed and empty.
#[derive(Debug)]
pub struct LaneStream<T> {
    control: mpsc::UnboundedReceiver<T>,
    data: mpsc::UnboundedReceiver<T>,
    control_done: bool,
    data_done: bool,
}

/// A pair of lanes and the stream that merges them, control first.
pub fn lanes<T>() -> (Lanes<T>, LaneStream<T>) {
    let (ctx, crx) = mpsc::unbounded_channel();
    let (dtx, drx) = mpsc::unbounded_channel();
    (
        Lanes {
            control: ctx,
            data: dtx,
        },
        LaneStream {
            control: crx,
            data: drx,
            control_done: false,
            data_done: false,
        },
    )
}

impl<T> Stream for LaneStream<T> {
    type Item = T;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<T>> {
        let me = &mut *self;
        if !me.control_done {
            match me.control.poll_recv(cx) {
                Poll::Ready(Some(m)) => return Poll::Ready(Some(m)),
                Poll::Ready(None) => me.control_done = true,
                Poll::Pending => {}
            }
        }
        if !me.data_done {
            match me.data.poll_recv(cx) {
                Poll::Ready(Some(m)) => return Poll::Ready(Some(m)),
                Poll::Ready(None) => me.data_done = true,
                Poll::Pending => {}
            }
        }
        if me.control_done && me.data_done {
            Poll::Ready(None)
        } else {
            Poll::Pending
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio_stream::StreamExt;

    #[tokio::test]
    async fn control_overtakes_queued_data() {
        let (tx, mut rx) = lanes::<u32>();
        for i in 0..1000 {
            tx.data.send(i).unwrap();
        }
        tx.control.send(7777).unwrap();
        assert_eq!(rx.next().await, Some(7777));
        assert_eq!(rx.next().await, Some(0));
        drop(tx);
        let mut rest = 0;
        while let Some(m) = rx.next().await {
            assert_eq!(m, rest + 1);
            rest += 1;
        }
        assert_eq!(rest, 999);
    }
}
