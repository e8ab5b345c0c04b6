//! The plugins directory: every library in it, loaded independently, each with its outcome.

use std::path::{Path, PathBuf};

use super::load::{load, LoadError, Plugin};

/// One library file and what became of it.
#[derive(Debug)]
pub struct RegistryEntry {
    pub path: PathBuf,
    pub outcome: Result<Plugin, LoadError>,
}

#[derive(Debug)]
pub struct Registry {
    pub dir: PathBuf,
    pub entries: Vec<RegistryEntry>,
}

/// The file name suffix of shared libraries on this platform.
pub const LIBRARY_SUFFIX: &str = std::env::consts::DLL_SUFFIX;

impl Registry {
    /// Loads every shared library in `dir` (and every symlink named like one, so that a broken
    /// link is reported rather than skipped); one bad library never stops the others. Two
    /// libraries of the same kind are both refused, each naming the other.
    pub fn scan(dir: &Path) -> std::io::Result<Registry> {
        let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)?
            .filter_map(|e| e.ok())
            .map(|e| e.path())
            .filter(|p| {
                (p.is_file() || p.is_symlink())
                    && p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.ends_with(LIBRARY_SUFFIX))
            })
            .collect();
        paths.sort();
        let mut entries: Vec<RegistryEntry> =
            paths.into_iter().map(|path| RegistryEntry { outcome: load(&path, None), path }).collect();
        refuse_duplicate_kinds(&mut entries);
        Ok(Registry { dir: dir.to_owned(), entries })
    }

    pub fn loaded(&self) -> impl Iterator<Item = &Plugin> {
        self.entries.iter().filter_map(|e| e.outcome.as_ref().ok())
    }

    /// The plugin of a kind, if one loaded.
    pub fn find(&self, kind: &str) -> Option<&Plugin> {
        self.loaded().find(|p| p.descriptor.kind.as_str() == kind)
    }

    /// The entry for a library path or a kind, for `plugins inspect`.
    pub fn entry(&self, kind_or_path: &str) -> Option<&RegistryEntry> {
        let as_path = std::fs::canonicalize(kind_or_path).ok();
        self.entries.iter().find(|e| {
            e.outcome.as_ref().is_ok_and(|p| p.descriptor.kind.as_str() == kind_or_path)
                || as_path.as_deref().is_some_and(|p| std::fs::canonicalize(&e.path).ok().as_deref() == Some(p))
        })
    }
}

fn refuse_duplicate_kinds(entries: &mut [RegistryEntry]) {
    let kind_of = |e: &RegistryEntry| e.outcome.as_ref().ok().map(|p| p.descriptor.kind.to_string());
    let kinds: Vec<Option<String>> = entries.iter().map(kind_of).collect();
    let names: Vec<String> = entries.iter().map(|e| file_name(&e.path)).collect();
    for (i, entry) in entries.iter_mut().enumerate() {
        let Some(kind) = &kinds[i] else { continue };
        let others: Vec<String> =
            (0..kinds.len()).filter(|&j| j != i && kinds[j].as_ref() == Some(kind)).map(|j| names[j].clone()).collect();
        if !others.is_empty() {
            let others = others.join(", ");
            entry.outcome = Err(LoadError::DuplicateKind { kind: kind.clone(), others });
        }
    }
}

/// Why no plugin could serve a manifest's drafter.
#[derive(Debug, thiserror::Error)]
pub enum SelectError {
    #[error("cannot read the plugins directory {dir}: {reason}")]
    Directory { dir: PathBuf, reason: String },
    #[error(
        "no plugin of kind `{kind}` in {dir}{named_by} (loaded kinds: {loaded}){refused}; put its \
         library there, or name the directory that holds it with --plugins-dir, $HOST_PLUGINS_DIR \
         or `plugins_dir` under the manifest's [drafter]"
    )]
    NoSuchKind { kind: String, dir: PathBuf, named_by: String, loaded: String, refused: String },
    #[error("no library in {dir} has the pinned sha256 {pin}")]
    NoPinnedLibrary { dir: PathBuf, pin: String },
    #[error("{path}: {error}")]
    Refused { path: PathBuf, error: LoadError },
    #[error("{path} has the pinned sha256 but is of kind `{found}`, not `{kind}`")]
    WrongKind { path: PathBuf, kind: String, found: String },
}

/// The plugin a manifest's drafter asks for. With a sha256 pin, only the library with that
/// hash is opened (hashes are computed before anything is loaded); without one, the
/// directory is scanned and the plugin of that kind chosen.
pub fn select(dir: &Path, kind: &str, pin: Option<&str>) -> Result<Plugin, SelectError> {
    let directory_error = |e: std::io::Error| SelectError::Directory { dir: dir.to_owned(), reason: e.to_string() };
    if let Some(pin) = pin {
        let candidates = std::fs::read_dir(dir).map_err(directory_error)?;
        let pinned = candidates
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.is_file() && p.to_string_lossy().ends_with(LIBRARY_SUFFIX))
            .find(|p| super::load::sha256_file(p).is_ok_and(|h| h.eq_ignore_ascii_case(pin)));
        let path = pinned.ok_or_else(|| SelectError::NoPinnedLibrary { dir: dir.to_owned(), pin: pin.to_owned() })?;
        let plugin = load(&path, Some(pin)).map_err(|error| SelectError::Refused { path: path.clone(), error })?;
        if plugin.descriptor.kind.as_str() != kind {
            return Err(SelectError::WrongKind {
                path,
                kind: kind.to_owned(),
                found: plugin.descriptor.kind.to_string(),
            });
        }
        return Ok(plugin);
    }
    let mut registry = Registry::scan(dir).map_err(directory_error)?;
    if let Some(plugin) = registry.find(kind) {
        return Ok(plugin.clone());
    }
    let duplicate =
        |e: &RegistryEntry| matches!(&e.outcome, Err(LoadError::DuplicateKind { kind: k, .. }) if k == kind);
    if let Some(at) = registry.entries.iter().position(duplicate) {
        let entry = registry.entries.swap_remove(at);
        let error = entry.outcome.expect_err("a refused entry");
        return Err(SelectError::Refused { path: entry.path, error });
    }
    let loaded: Vec<String> = registry.loaded().map(|p| p.descriptor.kind.to_string()).collect();
    let refused: Vec<String> = registry
        .entries
        .iter()
        .filter_map(|e| e.outcome.as_ref().err().map(|err| format!("{}: {err}", file_name(&e.path))))
        .collect();
    Err(SelectError::NoSuchKind {
        kind: kind.to_owned(),
        dir: dir.to_owned(),
        named_by: String::new(),
        loaded: if loaded.is_empty() { "none".into() } else { loaded.join(", ") },
        refused: if refused.is_empty() { String::new() } else { format!("; refused: {}", refused.join("; ")) },
    })
}

pub fn file_name(path: &Path) -> String {
    path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| path.display().to_string())
}
