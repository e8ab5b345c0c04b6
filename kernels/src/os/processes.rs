//! Other processes (and this one's threads) as the host and its tests see them: signals sent by
//! pid, a process's children, whether it still runs.

/// A signal to send to a process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Signal {
    /// Ctrl-C's SIGINT.
    Interrupt,
    /// SIGTERM, the request to stop.
    Terminate,
    /// SIGKILL.
    Kill,
}

/// Sends `signal` to process `pid`; false if it could not be sent, or where the system has no
/// signals (Windows).
pub fn send(pid: u32, signal: Signal) -> bool {
    send_to(pid as i64, signal)
}

/// Sends `signal` to every process of the process group `group`, as a terminal's Ctrl-C does to
/// its foreground group; false where it could not be sent, or the system has no signals.
pub fn send_to_group(group: u32, signal: Signal) -> bool {
    send_to(-(group as i64), signal)
}

fn send_to(target: i64, signal: Signal) -> bool {
    #[cfg(unix)]
    {
        let number = match signal {
            Signal::Interrupt => libc::SIGINT,
            Signal::Terminate => libc::SIGTERM,
            Signal::Kill => libc::SIGKILL,
        };
        // SAFETY: kill only sends a signal.
        unsafe { libc::kill(target as libc::pid_t, number) == 0 }
    }
    #[cfg(not(unix))]
    {
        let _ = (target, signal);
        false
    }
}

/// Starts `command` in a process group of its own, so that a terminal's Ctrl-C reaches only the
/// process that started it, which decides what its children are told. Nothing changes where
/// the system has no process groups.
pub fn in_own_group(command: &mut std::process::Command) -> &mut std::process::Command {
    #[cfg(unix)]
    {
        use std::os::unix::process::CommandExt;
        command.process_group(0)
    }
    #[cfg(not(unix))]
    command
}

/// Whether process `pid` exists (a zombie still does until its parent reaps it).
pub fn is_running(pid: u32) -> bool {
    #[cfg(unix)]
    // SAFETY: signal 0 only checks that the process exists and may be signalled.
    return unsafe { libc::kill(pid as libc::pid_t, 0) } == 0;
    #[cfg(not(unix))]
    {
        let _ = pid;
        false
    }
}

/// The children of process `pid`, started by any of its threads (Linux; empty elsewhere).
pub fn children(pid: u32) -> Vec<u32> {
    #[cfg(target_os = "linux")]
    {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return Vec::new() };
        let texts = tasks.filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("children")).ok());
        texts.flat_map(|text| text.split_whitespace().filter_map(|p| p.parse().ok()).collect::<Vec<u32>>()).collect()
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = pid;
        Vec::new()
    }
}

/// The names of this process's threads (Linux); `None` where they cannot be listed.
pub fn thread_names() -> Option<Vec<String>> {
    #[cfg(target_os = "linux")]
    {
        let tasks = std::fs::read_dir("/proc/self/task").ok()?;
        let comm = |t: std::fs::DirEntry| std::fs::read_to_string(t.path().join("comm")).ok();
        Some(tasks.filter_map(|t| comm(t.ok()?)).map(|name| name.trim().to_owned()).collect())
    }
    #[cfg(not(target_os = "linux"))]
    None
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    #[test]
    fn a_child_is_listed_signalled_and_gone() {
        let mut child = std::process::Command::new("sleep").arg("30").spawn().unwrap();
        assert!(children(std::process::id()).contains(&child.id()));
        assert!(is_running(child.id()));
        assert!(send(child.id(), Signal::Kill));
        child.wait().unwrap();
        assert!(!is_running(child.id()));
        let name = std::thread::current().name().map(|n| n.chars().take(15).collect::<String>());
        assert!(thread_names().unwrap().iter().any(|t| Some(t) == name.as_ref()));
    }
}
