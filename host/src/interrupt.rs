//! Ctrl-C as a request to stop: the first SIGINT sets a flag that the command line turns into
//! [`crate::generate::Flow::Stop`] at the next token, so what was produced is still printed;
//! a second SIGINT ends the process as usual (`kernels::os::signals`).

/// Installs the handler (once per process).
pub fn install() {
    kernels::os::signals::stop_at_first_interrupt();
}

/// Whether Ctrl-C was pressed since [`install`].
pub fn requested() -> bool {
    kernels::os::signals::interrupted()
}
