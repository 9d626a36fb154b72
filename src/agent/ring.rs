//! Following one of the datapath's ring buffers (the paused-traffic
//! reports, the flow log's events): what it holds at once, then whatever
//! is committed, for as long as `drain` says to go on.

use std::os::fd::AsRawFd;

use tokio::io::unix::AsyncFd;
use tracing::warn;

/// Spawns the task that drains `ring` with `drain` (false: stop; the agent
/// is gone) now and whenever it becomes readable; `what` names the ring in
/// warnings.
pub(super) fn follow<R>(
    ring: R,
    what: &'static str,
    mut drain: impl FnMut(&mut R) -> bool + Send + 'static,
) where
    R: AsRawFd + Send + 'static,
{
    tokio::spawn(async move {
        // SAFETY: the ring's fd is its map's, owned by the ring inside the
        // AsyncFd: open, and the same fd, for as long as the AsyncFd lives
        // (neither WakeRing nor FlowRing replaces it).
        let mut ring = match unsafe { AsyncFd::register(ring) } {
            Ok(r) => r,
            Err(e) => {
                warn!(error = %e, ring = what, "cannot poll the datapath's ring");
                return;
            }
        };
        // What the ring holds from before this start first.
        if !drain(ring.get_mut()) {
            return;
        }
        loop {
            let mut guard = match ring.readable_mut().await {
                Ok(g) => g,
                Err(e) => {
                    warn!(error = %e, ring = what, "polling the datapath's ring failed");
                    return;
                }
            };
            // Cleared before draining: a record committed while the ring
            // is drained sets readiness again (cleared after, its wakeup
            // could be lost until the next record).
            guard.clear_ready();
            if !drain(guard.get_inner_mut()) {
                return;
            }
        }
    });
}
