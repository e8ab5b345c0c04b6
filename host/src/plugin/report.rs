//! How plugins are shown to users: one line or one JSON object per library.

use serde_json::{json, Value};

use super::load::{LoadError, Plugin};
use super::registry::{file_name, RegistryEntry};

pub fn entry_json(entry: &RegistryEntry, verbose: bool) -> Value {
    match &entry.outcome {
        Ok(plugin) => plugin_json(plugin),
        Err(error) => refused_json(&entry.path, error, verbose),
    }
}

pub fn refused_json(path: &std::path::Path, error: &LoadError, verbose: bool) -> Value {
    let mut value = json!({ "path": path, "status": "refused", "reason": error.to_string() });
    if let (true, Some(detail)) = (verbose, error.detail()) {
        value["detail"] = json!(detail);
    }
    value
}

pub fn plugin_json(plugin: &Plugin) -> Value {
    let d = &plugin.descriptor;
    let c = &d.capabilities;
    json!({
        "path": plugin.path,
        "status": "loaded",
        "kind": d.kind.as_str(),
        "name": d.name.as_str(),
        "version": d.version.as_str(),
        "api_version": plugin.api_version,
        "summary": d.summary.as_str(),
        "needs_artifact": d.needs_artifact,
        "capabilities": {
            "ports": c.ports.names(),
            "tap_layers": c.tap_layers.as_slice(),
            "prefill_mode": c.prefill_mode.name(),
            "max_draft_tokens": c.max_draft_tokens,
            "draft_probabilities": c.draft_probabilities,
        },
        "options": d.options.iter().map(|o| json!({
            "key": o.key.as_str(), "default": o.default.as_str(), "doc": o.doc.as_str()
        })).collect::<Vec<_>>(),
    })
}

/// `kind  version  api  status` in columns, with the reason for a refused library.
pub fn entry_line(entry: &RegistryEntry, verbose: bool) -> String {
    let name = file_name(&entry.path);
    match &entry.outcome {
        Ok(p) => format!(
            "{:<12} {:<10} api {:<8} loaded   {}",
            p.descriptor.kind.as_str(),
            p.descriptor.version.as_str(),
            p.api_version,
            name
        ),
        Err(e) => {
            let mut line = format!("{:<12} {:<10} {:<12} refused  {name}: {e}", "-", "-", "");
            if let (true, Some(detail)) = (verbose, e.detail()) {
                line.push('\n');
                line.push_str(detail);
            }
            line
        }
    }
}

pub fn plugin_text(plugin: &Plugin) -> String {
    let d = &plugin.descriptor;
    let c = &d.capabilities;
    let mut out = format!(
        "kind          {}\nname          {}\nversion       {}\napi version   {}\nlibrary       {}\nsummary       {}\nartifact      {}\nports         {}\ntap layers    {}\nprefill       {}\nmax draft     {}\nprobabilities {}\n",
        d.kind,
        d.name,
        d.version,
        plugin.api_version,
        plugin.path.display(),
        d.summary,
        if d.needs_artifact { "required" } else { "none" },
        if c.ports.names().is_empty() { "none".into() } else { c.ports.names().join(", ") },
        if c.tap_layers.is_empty() { "none (or set by the artifact)".into() } else { format!("{:?}", c.tap_layers.as_slice()) },
        c.prefill_mode.name(),
        if c.max_draft_tokens == 0 {
            "none declared; a provider may set one when it loads (`host manifest check` shows it)".into()
        } else {
            c.max_draft_tokens.to_string()
        },
        if c.draft_probabilities { "yes" } else { "no" },
    );
    if !d.options.is_empty() {
        out.push_str("options ([drafter.options])\n");
        for o in d.options.iter() {
            out.push_str(&format!("  {} = {}    {}\n", o.key, o.default, o.doc));
        }
    }
    out
}
