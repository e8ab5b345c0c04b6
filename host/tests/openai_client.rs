//! The official `openai` Python package against `host serve` (tests/clients/openai_client.py):
//! completions and chat, streamed and not, errors, and a load test of 64 requests at
//! concurrency 16 on the demo target in which every greedy request equals its single run.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};

#[test]
fn the_openai_client_talks_to_the_server_under_load() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let python = root.join("tests/clients/.venv/bin/python");
    assert!(python.exists(), "{} is missing: run `bash tests/clients/setup.sh` (make test does)", python.display());
    let manifest = root.join("manifests/demo-ngram.toml");
    let mut server = Command::new(env!("CARGO_BIN_EXE_host"))
        .args(["serve", "--manifest", manifest.to_str().unwrap(), "--port", "0", "--max-batch", "16"])
        .args(["--api-key", "sesame"])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = BufReader::new(server.stderr.take().unwrap());
    let base = loop {
        let mut line = String::new();
        assert!(stderr.read_line(&mut line).unwrap() > 0, "host serve exited before listening");
        if let Some(address) = line.trim().strip_prefix("listening on ") {
            break address.to_owned();
        }
    };
    std::thread::spawn(move || std::io::copy(&mut stderr, &mut std::io::sink()));
    let out = Command::new(&python)
        .arg(root.join("tests/clients/openai_client.py"))
        .args(["--base-url", &format!("{base}/v1"), "--model", "kjv-gemma4", "--api-key", "sesame"])
        .output()
        .unwrap();
    let _ = server.kill();
    let _ = server.wait();
    assert!(
        out.status.success(),
        "openai_client.py failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let figures: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    println!("load test: {figures}");
    assert_eq!(figures["requests"], 64);
    assert!(figures["completion_tokens"].as_u64().unwrap() > 0);
}
