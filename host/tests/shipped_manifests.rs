//! Every manifest the repository ships for the demo target runs as `make run` runs the embedded
//! default: the drafter loads from the plugins beside the host, drafts, and (greedy, or sampled
//! with `match` verification) gives plain decoding's tokens.

use std::path::{Path, PathBuf};
use std::process::Command;

fn manifests() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../manifests");
    let mut found: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            let name = p.file_name().unwrap().to_string_lossy();
            name == "default.toml" || (name.starts_with("demo-") && name.ends_with(".toml"))
        })
        .collect();
    found.sort();
    found
}

#[test]
fn the_default_and_every_demo_manifest_run_and_match_plain_decoding() {
    let manifests = manifests();
    assert!(manifests.len() >= 8, "{manifests:?}");
    for manifest in manifests {
        let name = manifest.file_name().unwrap().to_string_lossy().into_owned();
        let args = ["run", "--manifest", manifest.to_str().unwrap(), "--max-tokens", "24", "--compare-plain", "--json"];
        let out = Command::new(env!("CARGO_BIN_EXE_host")).args(args).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{name}: {stderr}");
        let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(json["stats"]["generated_tokens"], 24, "{name}: {json}");
        if name == "demo-plain.toml" {
            continue;
        }
        assert!(json["stats"]["drafted"].as_u64().unwrap() > 0, "{name} drafted nothing: {json}");
        // Rejection sampling keeps the target's distribution, not plain decoding's draws.
        if !name.ends_with("-rejection.toml") {
            assert_eq!(json["plain"]["identical"], true, "{name}: {json}");
        }
    }
}
