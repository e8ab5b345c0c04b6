//! Requests to stop the process (Ctrl-C, SIGTERM) as flags that the host polls, and stopping
//! the processes it started.
//!
//! On Unix the handlers only store to an atomic (and, for [`stop_at_first_interrupt`], reset
//! the disposition), both async-signal-safe, and need no thread. Elsewhere nothing is
//! installed: Ctrl-C ends the process as the system does by default, and the flags stay unset.

use std::process::{Child, ExitStatus};
use std::sync::atomic::{AtomicI32, Ordering};

/// The signal (SIGINT or SIGTERM) that arrived first after [`stop_at_first_interrupt`]; 0 while
/// none has.
static INTERRUPTED_BY: AtomicI32 = AtomicI32::new(0);
/// The last SIGINT or SIGTERM not yet taken, after [`watch_stop_requests`]; 0 for none.
static STOP_REQUESTED: AtomicI32 = AtomicI32::new(0);

/// Makes the first Ctrl-C or SIGTERM a request to stop ([`interrupted`] then says which) and a
/// second one end the process as usual.
pub fn stop_at_first_interrupt() {
    #[cfg(unix)]
    {
        extern "C" fn on_signal(signal: libc::c_int) {
            let _ = INTERRUPTED_BY.compare_exchange(0, signal, Ordering::SeqCst, Ordering::SeqCst);
            // SAFETY: signal() is async-signal-safe; the default dispositions end the process
            // on the next SIGINT or SIGTERM.
            unsafe {
                libc::signal(libc::SIGINT, libc::SIG_DFL);
                libc::signal(libc::SIGTERM, libc::SIG_DFL);
            }
        }
        let handler = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
        // SAFETY: the handler is async-signal-safe (see above).
        unsafe {
            libc::signal(libc::SIGINT, handler);
            libc::signal(libc::SIGTERM, handler);
        }
    }
}

/// The signal number of the SIGINT or SIGTERM that asked to stop since
/// [`stop_at_first_interrupt`], if one did.
pub fn interrupted() -> Option<i32> {
    Some(INTERRUPTED_BY.load(Ordering::SeqCst)).filter(|&signal| signal != 0)
}

/// The exit status a process stopped by `signal` conventionally ends with: 128 + its number.
pub fn exit_status_for(signal: i32) -> i32 {
    128 + signal
}

/// Makes every SIGINT and SIGTERM a request to stop, taken with [`take_stop_request`].
pub fn watch_stop_requests() {
    #[cfg(unix)]
    {
        extern "C" fn on_signal(signal: libc::c_int) {
            STOP_REQUESTED.store(signal, Ordering::SeqCst);
        }
        let handler = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
        // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
        unsafe {
            libc::signal(libc::SIGINT, handler);
            libc::signal(libc::SIGTERM, handler);
        }
    }
}

/// The signal that requested a stop since the last call, if one did (after
/// [`watch_stop_requests`]).
pub fn take_stop_request() -> Option<StopSignal> {
    match STOP_REQUESTED.swap(0, Ordering::SeqCst) {
        0 => None,
        #[cfg(unix)]
        libc::SIGINT => Some(StopSignal::Interrupt),
        _ => Some(StopSignal::Terminate),
    }
}

/// Which request to stop arrived.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopSignal {
    /// SIGINT: Ctrl-C.
    Interrupt,
    /// SIGTERM.
    Terminate,
}

/// Passes `signal` on to `child`, so that it stops as this process was asked to; false where
/// it could not be sent.
pub fn pass_on(child: &Child, signal: StopSignal) -> bool {
    let signal = match signal {
        StopSignal::Interrupt => super::processes::Signal::Interrupt,
        StopSignal::Terminate => super::processes::Signal::Terminate,
    };
    super::processes::send(child.id(), signal)
}

/// Ignores SIGINT and SIGTERM: for a process whose stopping another one decides.
pub fn ignore_stop_requests() {
    #[cfg(unix)]
    // SAFETY: setting a signal's disposition to "ignore" has no handler to run.
    unsafe {
        libc::signal(libc::SIGINT, libc::SIG_IGN);
        libc::signal(libc::SIGTERM, libc::SIG_IGN);
    }
}

/// Asks `child` to stop (SIGTERM), so that it can finish what it holds; false where the system
/// has no such request (the caller then kills it).
pub fn ask_to_stop(child: &Child) -> bool {
    super::processes::send(child.id(), super::processes::Signal::Terminate)
}

/// The signal that ended a process, where it was one.
pub fn ending_signal(status: &ExitStatus) -> Option<i32> {
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        status.signal()
    }
    #[cfg(not(unix))]
    {
        let _ = status;
        None
    }
}

#[cfg(all(test, unix))]
mod tests {
    use super::*;

    #[test]
    fn a_stop_request_is_taken_once() {
        watch_stop_requests();
        // SAFETY: raise sends the signal to this process, whose handler only sets the flag.
        assert_eq!(unsafe { libc::raise(libc::SIGTERM) }, 0);
        assert_eq!(take_stop_request(), Some(StopSignal::Terminate));
        assert_eq!(take_stop_request(), None);
    }

    #[test]
    fn a_terminated_child_names_its_signal() {
        let mut child = std::process::Command::new("sleep").arg("30").spawn().unwrap();
        assert!(ask_to_stop(&child));
        let status = child.wait().unwrap();
        assert_eq!(ending_signal(&status), Some(libc::SIGTERM));
        let status = std::process::Command::new("true").status().unwrap();
        assert_eq!(ending_signal(&status), None);
    }
}
