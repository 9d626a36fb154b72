//! The small part of the systemd protocol the agent speaks today:
//! `sd_notify` datagrams (READY=1, STATUS=, STOPPING=1) to `$NOTIFY_SOCKET`.
//! Without the variable (not started by systemd) every call is a no-op.

use std::os::unix::net::UnixDatagram;

/// Sends one notification; returns whether it was sent.
pub fn notify(state: &str) -> bool {
    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else {
        return false;
    };
    let Ok(sock) = UnixDatagram::unbound() else {
        return false;
    };
    let bytes = path.as_encoded_bytes();
    let sent = if let Some(abstract_name) = bytes.strip_prefix(b"@") {
        use std::os::linux::net::SocketAddrExt;
        std::os::unix::net::SocketAddr::from_abstract_name(abstract_name)
            .and_then(|addr| sock.send_to_addr(state.as_bytes(), &addr))
    } else {
        sock.send_to(state.as_bytes(), &path)
    };
    sent.is_ok()
}
