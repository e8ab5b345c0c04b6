//! Ctrl-C or SIGTERM as a request to stop: the first sets a flag that the command line turns
//! into [`crate::generate::Flow::Stop`] at the next token, so what was produced is still printed
//! or written, and the process then exits with the signal's conventional status; a second one
//! ends the process as usual (`kernels::os::signals`).

/// Installs the handlers (once per process).
pub fn install() {
    kernels::os::signals::stop_at_first_interrupt();
}

/// Whether a stop was asked for since [`install`].
pub fn requested() -> bool {
    kernels::os::signals::interrupted().is_some()
}

/// The exit status for the signal that asked to stop, if one did: 130 after Ctrl-C, 143 after
/// SIGTERM.
pub fn exit_status() -> Option<i32> {
    kernels::os::signals::interrupted().map(kernels::os::signals::exit_status_for)
}
