//! Model ids (`ORG/NAME`, `ORG/NAME@REVISION`) resolved offline through the local Hugging Face
//! cache, laid out as `huggingface_hub` writes it: `models--ORG--NAME/refs/main` holds the
//! commit of `snapshots/<commit>/`, whose files link into `blobs/`.

use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
#[error("model `{spec}` not found: {searched}")]
pub struct NotFound {
    pub spec: String,
    pub searched: String,
}

/// `spec` as a directory relative to `base`, else as a model id in the Hugging Face cache.
pub fn resolve(spec: &str, base: &Path) -> Result<PathBuf, NotFound> {
    let as_path = base.join(spec);
    if as_path.is_dir() {
        return Ok(as_path);
    }
    let mut searched = vec![format!("no directory {}", as_path.display())];
    if let Some((id, revision)) = model_id(spec) {
        let repo = cache_root().join(format!("models--{}", id.replace('/', "--")));
        match snapshot(&repo, revision) {
            Some(dir) if dir.join("config.json").exists() => return Ok(dir),
            Some(dir) => searched.push(format!("the cached snapshot {} has no config.json", dir.display())),
            None => searched.push(format!("not in the Hugging Face cache ({})", repo.display())),
        }
    }
    Err(NotFound { spec: spec.to_owned(), searched: searched.join("; ") })
}

/// (`ORG/NAME`, revision) when `spec` has that shape.
fn model_id(spec: &str) -> Option<(&str, &str)> {
    let (id, revision) = spec.split_once('@').unwrap_or((spec, "main"));
    let (org, name) = id.split_once('/')?;
    let fine = |part: &str| !part.is_empty() && !part.starts_with('.') && !part.contains(['/', '\\']);
    (fine(org) && fine(name) && !revision.is_empty()).then_some((id, revision))
}

/// `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`.
pub fn cache_root() -> PathBuf {
    if let Some(dir) = std::env::var_os("HF_HUB_CACHE") {
        return PathBuf::from(dir);
    }
    if let Some(home) = std::env::var_os("HF_HOME") {
        return PathBuf::from(home).join("hub");
    }
    let home = std::env::var_os("HOME").map_or_else(|| PathBuf::from("."), PathBuf::from);
    home.join(".cache/huggingface/hub")
}

/// The snapshot directory of `revision`: a ref (`refs/<revision>` holds the commit) or a commit.
fn snapshot(repo: &Path, revision: &str) -> Option<PathBuf> {
    let commit = std::fs::read_to_string(repo.join("refs").join(revision))
        .map(|c| c.trim().to_owned())
        .unwrap_or_else(|_| revision.to_owned());
    let dir = repo.join("snapshots").join(commit);
    dir.is_dir().then_some(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_have_an_org_a_name_and_maybe_a_revision() {
        assert_eq!(model_id("google/gemma-4"), Some(("google/gemma-4", "main")));
        assert_eq!(model_id("google/gemma-4@abc123"), Some(("google/gemma-4", "abc123")));
        for not_an_id in ["gemma", "../x", "a/b/c", "/abs", "a/", "a/b@"] {
            assert_eq!(model_id(not_an_id), None, "{not_an_id}");
        }
    }
}
