//! Loading one plugin library, with every check that can refuse it, in the order that keeps
//! untrusted code from running early: file checks and the sha256 pin before the library is
//! opened, the API major before the layout check, the layout check before the plugin's code.

use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};

use abi_stable::library::{lib_header_from_path, LibHeader, LibraryError, RootModuleError};
use abi_stable::StableAbi;
use kernels::os::files::{is_symlink_loop, writable_by_others};
use kernels::os::object_format::{self, Refusal};
use plugin_api::abi::DrafterRootRef;
use plugin_api::{Descriptor, PluginError, API_MAJOR, API_VERSION};
use sha2::{Digest, Sha256};

/// Why a library was refused. Each message is one line; `AbiMismatch` keeps the full layout
/// report for `--verbose`.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("cannot read {path}: {reason}")]
    Unreadable { path: PathBuf, reason: String },
    #[error("{what} is writable by group or others (mode {mode:o}); refusing to load code from it")]
    UnsafePermissions { what: String, mode: u32 },
    #[error("sha256 mismatch: the manifest pins {expected}, the file has {actual}")]
    HashMismatch { expected: String, actual: String },
    #[error("not a shared library (no {0} header)")]
    NotSharedLibrary(&'static str),
    #[error("not loadable: {0}")]
    Damaged(String),
    #[error("cannot open the library: {0}")]
    Open(String),
    #[error("not a drafter plugin (no plugin root symbol; was it built with plugin_api::export_drafter!?)")]
    NotAPlugin,
    #[error(
        "built for plugin API {found}, this host speaks {expected}; rebuild it against plugin-api {expected_major}.x"
    )]
    ApiMajor { found: String, expected: String, expected_major: u32 },
    #[error("ABI layout mismatch with plugin API {API_VERSION}: {summary}")]
    AbiMismatch { summary: String, detail: String },
    #[error("the plugin panicked while loading")]
    PanicAtLoad,
    #[error("the plugin failed while loading: {0}")]
    InitFailed(String),
    #[error("its descriptor: {0}")]
    Descriptor(PluginError),
    #[error("kind `{kind}` is also provided by {others}; keep one library per kind in the directory")]
    DuplicateKind { kind: String, others: String },
}

impl LoadError {
    /// The full report behind a one-line message, where there is more to say.
    pub fn detail(&self) -> Option<&str> {
        match self {
            LoadError::AbiMismatch { detail, .. } => Some(detail),
            _ => None,
        }
    }
}

/// A loaded, checked plugin library. Libraries are never unloaded.
#[derive(Clone)]
pub struct Plugin {
    pub path: PathBuf,
    pub api_version: String,
    pub descriptor: Descriptor,
    pub root: DrafterRootRef,
}

impl std::fmt::Debug for Plugin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Plugin").field("path", &self.path).field("kind", &self.descriptor.kind).finish()
    }
}

impl Plugin {
    /// The plugin's extension table `T` for a versioned id: `Ok(None)` when the plugin does
    /// not have it (an older plugin), an error when its layout differs from `T`'s.
    pub fn extension<T: StableAbi>(&self, id: &str) -> Result<Option<&'static T>, String> {
        extension(self.root, id)
    }
}

/// The extension table `T` that the plugin of `root` offers under a versioned id (see
/// [`Plugin::extension`]).
pub fn extension<T: StableAbi>(root: DrafterRootRef, id: &str) -> Result<Option<&'static T>, String> {
    plugin_api::extension::find(root, id)
        .map_err(|report| format!("extension `{id}`: {}", summarize_layout_report(&report)))
}

/// Loads the library at `path` after checking it; `pin` is a manifest's sha256 for it.
pub fn load(path: &Path, pin: Option<&str>) -> Result<Plugin, LoadError> {
    let path = fs::canonicalize(path).map_err(|e| match fs::symlink_metadata(path) {
        Ok(link) if link.is_symlink() && is_symlink_loop(&e) => {
            LoadError::Unreadable { path: path.to_owned(), reason: "a symlink loop".into() }
        }
        Ok(link) if link.is_symlink() => {
            LoadError::Unreadable { path: path.to_owned(), reason: format!("a symlink to nothing ({e})") }
        }
        _ => unreadable(path, e),
    })?;
    check_permissions(&path)?;
    let bytes = fs::read(&path).map_err(|e| unreadable(&path, e))?;
    if let Some(expected) = pin {
        let actual = format!("{:x}", Sha256::digest(&bytes));
        if !actual.eq_ignore_ascii_case(expected.trim()) {
            return Err(LoadError::HashMismatch { expected: expected.trim().to_lowercase(), actual });
        }
    }
    object_format::check_native(&bytes).map_err(|refusal| match refusal {
        Refusal::NoHeader(format) => LoadError::NotSharedLibrary(format.name()),
        Refusal::Damaged(why) => LoadError::Damaged(why),
    })?;
    drop(bytes);

    let header = lib_header_from_path(&path).map_err(open_error)?;
    let api_version = header.version_strings().version.to_string();
    check_api_major(&api_version)?;
    let root = init_root(header)?;
    let descriptor = (root.descriptor())().into_result().map_err(LoadError::Descriptor)?;
    let plugin = Plugin { path, api_version, descriptor, root };
    share_helper(&plugin);
    Ok(plugin)
}

/// Hands the host's helper thread to the plugin, so that one helper serves the process
/// (`kernels::helper`). A plugin without the extension, or with another layout of it,
/// keeps its own.
fn share_helper(plugin: &Plugin) {
    use plugin_api::shared_helper::{shared, SharedHelperExtension, SHARED_HELPER_ID};
    if let Ok(Some(table)) = plugin.extension::<SharedHelperExtension>(SHARED_HELPER_ID) {
        (table.share)(shared());
    }
}

/// SHA-256 of a file, as lowercase hex (what a manifest's `sha256` pins).
pub fn sha256_file(path: &Path) -> std::io::Result<String> {
    let mut file = fs::File::open(path)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(format!("{:x}", hasher.finalize()))
}

fn unreadable(path: &Path, e: std::io::Error) -> LoadError {
    LoadError::Unreadable { path: path.to_owned(), reason: e.to_string() }
}

/// Refuses a library, or the directory holding it, that others could have replaced.
fn check_permissions(path: &Path) -> Result<(), LoadError> {
    let dir = path.parent().unwrap_or(Path::new("/"));
    for (what, target) in [("the library", path), ("its directory", dir)] {
        let meta = fs::metadata(target).map_err(|e| unreadable(target, e))?;
        if let Some(mode) = writable_by_others(&meta) {
            return Err(LoadError::UnsafePermissions { what: format!("{what} {}", target.display()), mode });
        }
    }
    Ok(())
}

fn check_api_major(version: &str) -> Result<(), LoadError> {
    let major = version.split('.').next().and_then(|m| m.parse::<u32>().ok());
    if major != Some(API_MAJOR) {
        return Err(LoadError::ApiMajor {
            found: version.to_owned(),
            expected: API_VERSION.to_owned(),
            expected_major: API_MAJOR,
        });
    }
    Ok(())
}

fn init_root(header: &'static LibHeader) -> Result<DrafterRootRef, LoadError> {
    header.init_root_module::<DrafterRootRef>().map_err(|e| match e {
        LibraryError::AbiInstability(report) => {
            let detail = report.to_string();
            LoadError::AbiMismatch { summary: summarize_layout_report(&detail), detail }
        }
        LibraryError::RootModule { err: RootModuleError::Unwound, .. } => LoadError::PanicAtLoad,
        LibraryError::RootModule { err: RootModuleError::Returned(inner), .. } => {
            LoadError::InitFailed(inner.to_string())
        }
        LibraryError::IncompatibleVersionNumber { expected_version, actual_version, .. } => LoadError::ApiMajor {
            found: actual_version.to_string(),
            expected: expected_version.to_string(),
            expected_major: API_MAJOR,
        },
        other => LoadError::Open(first_line(&other.to_string())),
    })
}

fn open_error(e: LibraryError) -> LoadError {
    match e {
        LibraryError::GetSymbolError { .. } => LoadError::NotAPlugin,
        LibraryError::OpenError { err, .. } => LoadError::Open(first_line(&err.to_string())),
        LibraryError::InvalidAbiHeader(found) => LoadError::Open(invalid_header(&found)),
        other => LoadError::Open(first_line(&other.to_string())),
    }
}

/// Why a library's root symbol is not the header abi_stable expects: not abi_stable's at all
/// (another program's symbol of that name), or another abi_stable major.
fn invalid_header(found: &abi_stable::library::AbiHeader) -> String {
    let expected = abi_stable::library::AbiHeader::VALUE;
    if found.magic_string != expected.magic_string {
        "its plugin root symbol is not an abi_stable library header: it was not built with \
         plugin-api's export_drafter!"
            .to_owned()
    } else {
        format!(
            "built with abi_stable {}.{}, which cannot load beside this host's {}.{}",
            found.abi_major, found.abi_minor, expected.abi_major, expected.abi_minor
        )
    }
}

fn first_line(text: &str) -> String {
    text.lines().map(str::trim).find(|l| !l.is_empty()).unwrap_or("").to_owned()
}

/// abi_stable's layout report runs to hundreds of lines; the last "Error:" with its
/// "Expected:"/"Found:" values is what a user needs.
fn summarize_layout_report(report: &str) -> String {
    let lines: Vec<&str> = report.lines().map(str::trim).filter(|l| !l.is_empty()).collect();
    let Some(at) = lines.iter().rposition(|l| l.starts_with("Error:")) else {
        return first_line(report);
    };
    let error = lines[at].trim_start_matches("Error:").trim();
    let value = |label: &str| {
        lines[at + 1..].iter().position(|l| l.starts_with(label)).map(|i| {
            let rest = lines[at + 1 + i].trim_start_matches(label).trim();
            if rest.is_empty() {
                lines.get(at + 2 + i).copied().unwrap_or("").to_owned()
            } else {
                rest.to_owned()
            }
        })
    };
    match (value("Expected:"), value("Found:")) {
        (Some(expected), Some(found)) => format!("{error} (expected {expected}, found {found})"),
        _ => error.to_owned(),
    }
}
