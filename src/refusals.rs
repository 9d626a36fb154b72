//! One log line per refused request — bad input, no such network, a port
//! in use, access denied — at info, with who asked (bus name or process,
//! uid), the method, the sandbox id and the error's name, so an operator
//! can see in the journal why a runtime's call failed. Both wire edges
//! report here. A flood from one uid cannot fill the journal: at most
//! [`BURST`] lines per uid (or caller, when the uid is unknown) per
//! [`WINDOW`]; the first refusal after a window with suppressed lines says
//! how many were left out.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tracing::info;

pub const BURST: u32 = 20;
pub const WINDOW: Duration = Duration::from_secs(10);
/// Callers tracked at once; beyond that the table starts over.
const MAX_CALLERS: usize = 4096;

/// Who made a refused request.
#[derive(Debug, Clone, Copy)]
pub struct Caller<'a> {
    /// "dbus", "varlink" or "report" (the metrics socket).
    pub edge: &'a str,
    /// The D-Bus unique name, or the varlink caller's command.
    pub name: &'a str,
    pub uid: Option<u32>,
    pub pid: Option<i32>,
}

/// What was refused.
#[derive(Debug, Clone, Copy)]
pub struct Refusal<'a> {
    pub method: &'a str,
    /// "" when the call names none (or it did not parse).
    pub sandbox_id: &'a str,
    /// The wire error's short name (InvalidArgument, NotFound, AccessDenied...).
    pub error: &'a str,
    pub message: &'a str,
}

struct Window {
    start: Instant,
    logged: u32,
    suppressed: u64,
}

static CALLERS: Mutex<Option<HashMap<String, Window>>> = Mutex::new(None);

/// Whether a refusal by `key` at `now` is logged, and how many refusals
/// of an earlier window were left out (to say so).
fn admit(key: &str, now: Instant) -> (bool, u64) {
    let mut guard = CALLERS.lock().unwrap_or_else(|p| p.into_inner());
    let map = guard.get_or_insert_with(HashMap::new);
    if map.len() >= MAX_CALLERS && !map.contains_key(key) {
        map.clear();
    }
    let w = map.entry(key.to_owned()).or_insert(Window {
        start: now,
        logged: 0,
        suppressed: 0,
    });
    let mut left_out = 0;
    if now.duration_since(w.start) >= WINDOW {
        left_out = std::mem::take(&mut w.suppressed);
        w.start = now;
        w.logged = 0;
    }
    if w.logged < BURST {
        w.logged += 1;
        (true, left_out)
    } else {
        w.suppressed += 1;
        (false, left_out)
    }
}

/// Logs a refused request (rate-limited per uid).
pub fn note(caller: Caller<'_>, r: Refusal<'_>) {
    let key = match caller.uid {
        Some(uid) => format!("uid {uid}"),
        None => format!("{} {}", caller.edge, caller.name),
    };
    let (log, left_out) = admit(&key, Instant::now());
    if !log {
        return;
    }
    info!(
        edge = caller.edge,
        caller = caller.name,
        uid = caller.uid,
        pid = caller.pid,
        method = r.method,
        sandbox_id = r.sandbox_id,
        error = r.error,
        suppressed_before = left_out,
        "request refused: {}",
        r.message
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flood_is_cut_to_a_burst_per_window_and_counted() {
        let t0 = Instant::now();
        let key = "test-flood";
        let logged = (0..100).filter(|_| admit(key, t0).0).count();
        assert_eq!(logged, BURST as usize);
        // Another caller is not affected.
        assert!(admit("test-other", t0).0);
        // The next window logs again and says how many were left out.
        let (log, left_out) = admit(key, t0 + WINDOW);
        assert!(log);
        assert_eq!(left_out, 100 - u64::from(BURST));
    }
}
