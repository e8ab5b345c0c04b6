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
    /// Loads every shared library in `dir`; one bad library never stops the others.
    pub fn scan(dir: &Path) -> std::io::Result<Registry> {
        let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)?
            .filter_map(|e| e.ok())
            .map(|e| e.path())
            .filter(|p| p.is_file() && p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.ends_with(LIBRARY_SUFFIX)))
            .collect();
        paths.sort();
        let entries = paths.into_iter().map(|path| RegistryEntry { outcome: load(&path, None), path }).collect();
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
