//! What the plugin loader asks of a file beyond the standard library.

use std::fs::Metadata;
use std::path::Path;

/// The permission bits (`mode & 0o7777`) when group or others may write the file; `None` when
/// they may not, or where permissions are not Unix modes (Windows' ACLs are not checked).
pub fn writable_by_others(meta: &Metadata) -> Option<u32> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = meta.permissions().mode();
        (mode & 0o022 != 0).then_some(mode & 0o7777)
    }
    #[cfg(not(unix))]
    {
        let _ = meta;
        None
    }
}

/// Whether `e` says a path's symbolic links loop.
pub fn is_symlink_loop(e: &std::io::Error) -> bool {
    #[cfg(unix)]
    return e.raw_os_error() == Some(libc::ELOOP);
    #[cfg(not(unix))]
    {
        let _ = e;
        false
    }
}

/// A symbolic link at `link` to `original` (a file's link on Windows).
pub fn symlink(original: impl AsRef<Path>, link: impl AsRef<Path>) -> std::io::Result<()> {
    #[cfg(unix)]
    return std::os::unix::fs::symlink(original, link);
    #[cfg(windows)]
    return std::os::windows::fs::symlink_file(original, link);
    #[cfg(not(any(unix, windows)))]
    {
        let _ = (original, link);
        Err(std::io::Error::new(std::io::ErrorKind::Unsupported, "symbolic links"))
    }
}

/// Sets a file's Unix permission bits; nothing where permissions are not Unix modes.
pub fn set_mode(path: impl AsRef<Path>, mode: u32) -> std::io::Result<()> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
    }
    #[cfg(not(unix))]
    {
        let _ = (path, mode);
        Ok(())
    }
}

#[cfg(all(test, unix))]
mod tests {
    use super::*;

    #[test]
    fn group_or_world_writable_files_are_named_with_their_mode() {
        let dir = std::env::temp_dir().join(format!("kernels-files-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("f");
        std::fs::write(&file, b"x").unwrap();
        for (mode, expected) in [(0o644, None), (0o664, Some(0o664)), (0o646, Some(0o646))] {
            set_mode(&file, mode).unwrap();
            assert_eq!(writable_by_others(&std::fs::metadata(&file).unwrap()), expected, "{mode:o}");
        }
        let (a, b) = (dir.join("a"), dir.join("b"));
        symlink(&b, &a).unwrap();
        symlink(&a, &b).unwrap();
        assert!(is_symlink_loop(&std::fs::canonicalize(&a).unwrap_err()));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

/// Whether the reader of this process's stdout has gone (a pipe whose other end closed), found
/// without writing: `host run --json` writes only at the end, and would otherwise decode to the
/// end for no one. False where the system cannot say (Windows) or stdout is a file or terminal.
pub fn stdout_reader_gone() -> bool {
    #[cfg(unix)]
    return reader_gone(libc::STDOUT_FILENO);
    #[cfg(not(unix))]
    false
}

#[cfg(unix)]
fn reader_gone(fd: libc::c_int) -> bool {
    let mut poll = libc::pollfd { fd, events: 0, revents: 0 };
    // SAFETY: one valid pollfd and a zero timeout; poll only writes `revents`.
    let ready = unsafe { libc::poll(&mut poll, 1, 0) };
    ready > 0 && poll.revents & (libc::POLLERR | libc::POLLHUP) != 0
}

#[cfg(all(test, unix))]
mod reader_tests {
    #[test]
    fn a_pipe_whose_reader_closed_is_seen_and_an_open_one_is_not() {
        let mut fds = [0; 2];
        // SAFETY: pipe writes two descriptors into the array, which this test closes.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        let [read, write] = fds;
        assert!(!super::reader_gone(write));
        // SAFETY: closing descriptors this test opened.
        unsafe { libc::close(read) };
        assert!(super::reader_gone(write));
        // SAFETY: as above.
        unsafe { libc::close(write) };
    }
}
