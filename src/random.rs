//! The kernel's random source.

/// Fills `buf` from the kernel's random source (getrandom(2)).
pub(crate) fn getrandom(buf: &mut [u8]) -> std::io::Result<()> {
    // SAFETY: the kernel writes at most buf.len() bytes into buf, which is a
    // valid, exclusively borrowed buffer.
    let n = unsafe { libc::getrandom(buf.as_mut_ptr().cast(), buf.len(), 0) };
    if n == buf.len() as isize {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}
