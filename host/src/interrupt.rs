//! Ctrl-C as a request to stop: the first SIGINT sets a flag that the command line turns into
//! [`crate::generate::Flow::Stop`] at the next token, so what was produced is still printed;
//! a second SIGINT ends the process as usual. Written on libc directly: the handler only
//! stores to an atomic and resets the disposition, both async-signal-safe, and needs no thread.

use std::sync::atomic::{AtomicBool, Ordering};

static REQUESTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_sigint(_: libc::c_int) {
    REQUESTED.store(true, Ordering::SeqCst);
    // SAFETY: signal() is async-signal-safe; the default disposition ends the process on the
    // next Ctrl-C.
    unsafe { libc::signal(libc::SIGINT, libc::SIG_DFL) };
}

/// Installs the handler (once per process).
pub fn install() {
    let handler = on_sigint as extern "C" fn(libc::c_int) as libc::sighandler_t;
    // SAFETY: the handler is async-signal-safe (see above).
    unsafe { libc::signal(libc::SIGINT, handler) };
}

/// Whether Ctrl-C was pressed since [`install`].
pub fn requested() -> bool {
    REQUESTED.load(Ordering::SeqCst)
}
