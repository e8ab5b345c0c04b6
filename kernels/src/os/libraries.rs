//! Which shared libraries this process has loaded, and which of them provides a symbol: what
//! `host doctor` reports rather than assuming what setup installed.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// Every shared library loaded into this process (Linux: the files mapped, from
/// `/proc/self/maps`; macOS: dyld's images). Unsupported elsewhere.
pub fn loaded() -> std::io::Result<BTreeSet<PathBuf>> {
    #[cfg(target_os = "linux")]
    {
        let maps = std::fs::read_to_string("/proc/self/maps")?;
        Ok(maps
            .lines()
            .filter_map(|line| line.split_whitespace().nth(5))
            .filter(|path| path.starts_with('/'))
            .map(PathBuf::from)
            .collect())
    }
    #[cfg(target_os = "macos")]
    {
        // dyld's own C interface (<mach-o/dyld.h>), stable since macOS 10.0.
        extern "C" {
            fn _dyld_image_count() -> u32;
            fn _dyld_get_image_name(index: u32) -> *const libc::c_char;
        }
        // SAFETY: dyld's image names are static strings, valid for an index below the count.
        let names = (0..unsafe { _dyld_image_count() }).filter_map(|i| unsafe {
            let name = _dyld_get_image_name(i);
            (!name.is_null()).then(|| PathBuf::from(std::ffi::CStr::from_ptr(name).to_string_lossy().into_owned()))
        });
        Ok(names.collect())
    }
    #[cfg(not(any(target_os = "linux", target_os = "macos")))]
    Err(std::io::Error::new(std::io::ErrorKind::Unsupported, "listing loaded libraries"))
}

/// Whether `path` names MLX's shared library on this platform (`libmlx.so*`, `libmlx.dylib`,
/// `mlx.dll`).
pub fn is_libmlx(path: &Path) -> bool {
    let Some(name) = path.file_name().and_then(|n| n.to_str()) else { return false };
    name.starts_with("libmlx.so") || name == "libmlx.dylib" || name.eq_ignore_ascii_case("mlx.dll")
}

/// The file of the loaded library that provides `symbol` to the process.
pub fn providing(symbol: &str) -> Option<PathBuf> {
    #[cfg(unix)]
    {
        use std::ffi::{CStr, CString};
        let name = CString::new(symbol).ok()?;
        // SAFETY: dlsym with RTLD_DEFAULT searches the global scope; a null result means absent.
        let address = unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) };
        if address.is_null() {
            return None;
        }
        // SAFETY: dladdr only reads the address and fills `info` with static strings.
        let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
        if unsafe { libc::dladdr(address, &mut info) } == 0 || info.dli_fname.is_null() {
            return None;
        }
        let file = unsafe { CStr::from_ptr(info.dli_fname) };
        Some(PathBuf::from(file.to_string_lossy().into_owned()))
    }
    #[cfg(not(unix))]
    {
        let _ = symbol;
        None
    }
}

/// The text returned by `symbol`, a `const char *symbol(void)` searched in the already loaded
/// `library` and its dependencies (such as OpenBLAS's `openblas_get_config`).
pub fn text_of(library: &Path, symbol: &str) -> Option<String> {
    #[cfg(unix)]
    {
        use std::ffi::{CStr, CString};
        use std::os::unix::ffi::OsStrExt;
        let path = CString::new(library.as_os_str().as_bytes()).ok()?;
        let symbol = CString::new(symbol).ok()?;
        // SAFETY: RTLD_NOLOAD only returns a handle to a library already loaded; the symbol is
        // declared to have the signature `const char *f(void)` and return a static string.
        unsafe {
            let handle = libc::dlopen(path.as_ptr(), libc::RTLD_LAZY | libc::RTLD_NOLOAD);
            if handle.is_null() {
                return None;
            }
            let function = libc::dlsym(handle, symbol.as_ptr());
            let text = (!function.is_null()).then(|| {
                let function: extern "C" fn() -> *const libc::c_char = std::mem::transmute(function);
                CStr::from_ptr(function()).to_string_lossy().into_owned()
            });
            libc::dlclose(handle);
            text
        }
    }
    #[cfg(not(unix))]
    {
        let _ = (library, symbol);
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn libmlx_is_named_as_each_platform_names_it() {
        for yes in ["/x/libmlx.so", "/x/libmlx.so.0.32", "/x/libmlx.dylib", "C:/x/mlx.dll"] {
            assert!(is_libmlx(Path::new(yes)), "{yes}");
        }
        for no in ["/x/libmlxc.a", "/x/libmlx-other.so", "/x/mlx.so"] {
            assert!(!is_libmlx(Path::new(no)), "{no}");
        }
    }

    #[cfg(any(target_os = "linux", target_os = "macos"))]
    #[test]
    fn the_process_lists_the_c_library_it_runs_on() {
        let loaded = loaded().unwrap();
        let libc = providing("malloc").expect("malloc is provided");
        let name = libc.file_name().unwrap();
        assert!(loaded.iter().any(|p| p.file_name() == Some(name)), "{libc:?} not among {loaded:?}");
    }
}
