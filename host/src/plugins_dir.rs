//! Where drafter plugins are looked for.

use std::path::{Path, PathBuf};

/// The environment variable that names the plugins directory when no flag does.
pub const PLUGINS_DIR_ENV: &str = "HOST_PLUGINS_DIR";

/// The plugins directory, and what named it.
#[derive(Clone, Debug)]
pub struct PluginsDir {
    pub path: PathBuf,
    pub origin: Origin,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Origin {
    Flag,
    Manifest,
    Environment,
    Executable,
}

/// The plugins directory: the `--plugins-dir` flag, else `$HOST_PLUGINS_DIR`, else the
/// directory of the host executable (where cargo puts the workspace's plugin libraries). A
/// manifest may name its own ([`PluginsDir::for_manifest`]).
pub fn resolve(flag: Option<PathBuf>) -> PluginsDir {
    if let Some(path) = flag {
        return PluginsDir { path, origin: Origin::Flag };
    }
    if let Some(path) = std::env::var_os(PLUGINS_DIR_ENV).filter(|v| !v.is_empty()) {
        return PluginsDir { path: path.into(), origin: Origin::Environment };
    }
    let path = std::env::current_exe().ok().and_then(|exe| exe.parent().map(PathBuf::from));
    PluginsDir { path: path.unwrap_or_else(|| PathBuf::from(".")), origin: Origin::Executable }
}

impl PluginsDir {
    /// The directory for a manifest whose `[drafter]` names `named` (resolved against the
    /// manifest's own directory): it wins over the environment and the executable's directory,
    /// and `--plugins-dir` wins over it.
    pub fn for_manifest(&self, named: Option<&Path>) -> PluginsDir {
        match named {
            Some(path) if self.origin != Origin::Flag => PluginsDir { path: path.to_owned(), origin: Origin::Manifest },
            _ => self.clone(),
        }
    }

    /// What named the directory, in words.
    pub fn named_by(&self) -> &'static str {
        match self.origin {
            Origin::Flag => "--plugins-dir",
            Origin::Manifest => "the manifest's plugins_dir",
            Origin::Environment => "$HOST_PLUGINS_DIR",
            Origin::Executable => {
                "the host executable's directory, as neither --plugins-dir nor $HOST_PLUGINS_DIR names one"
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_manifests_directory_wins_over_all_but_the_flag() {
        let named = Path::new("/from/manifest");
        for origin in [Origin::Environment, Origin::Executable] {
            let dir = PluginsDir { path: "/default".into(), origin }.for_manifest(Some(named));
            assert_eq!((dir.path.as_path(), dir.origin), (named, Origin::Manifest));
        }
        let flag = PluginsDir { path: "/flag".into(), origin: Origin::Flag };
        assert_eq!(flag.for_manifest(Some(named)).path, Path::new("/flag"));
        let env = PluginsDir { path: "/env".into(), origin: Origin::Environment };
        assert_eq!(env.for_manifest(None).origin, Origin::Environment);
    }
}
