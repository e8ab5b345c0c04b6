//! A new user's first steps: a model by path or by Hugging Face id without a manifest, the
//! version line, shell completions.

mod common;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::{plugins_dir_with, workspace_plugin};

fn host(args: &[&str], envs: &[(&str, &Path)]) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_host"));
    command.args(args).env_remove("HF_HUB_CACHE").env_remove("HF_HOME");
    for (key, value) in envs {
        command.env(key, value);
    }
    command.output().unwrap()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn dense() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/gemma4/dense").canonicalize().unwrap()
}

fn tokens(out: &Output) -> Vec<u64> {
    assert!(out.status.success(), "{}", text(&out.stderr));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    json["tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap()).collect()
}

/// A Hugging Face cache holding the dense fixture as `test/dense`, laid out as huggingface_hub
/// writes it: files in `blobs/` named by hash, a snapshot of symbolic links, `refs/main`.
fn hub_cache(root: &Path) {
    let repo = root.join("models--test--dense");
    let commit = "0123456789abcdef0123456789abcdef01234567";
    let snapshot = repo.join("snapshots").join(commit);
    fs::create_dir_all(repo.join("blobs")).unwrap();
    fs::create_dir_all(&snapshot).unwrap();
    fs::create_dir_all(repo.join("refs")).unwrap();
    fs::write(repo.join("refs/main"), commit).unwrap();
    for (i, entry) in fs::read_dir(dense()).unwrap().enumerate() {
        let path = entry.unwrap().path();
        let blob = format!("blob{i:04}");
        fs::copy(&path, repo.join("blobs").join(&blob)).unwrap();
        kernels::os::files::symlink(format!("../../blobs/{blob}"), snapshot.join(path.file_name().unwrap())).unwrap();
    }
}

#[test]
fn a_model_runs_without_a_manifest_by_path_and_by_cached_id() {
    let args = ["--prompt-ids", "2,17,40", "--max-tokens", "6", "--temperature", "0", "--json"];
    let dense = dense();
    let by_path = tokens(&host(&[&["run", "--model", dense.to_str().unwrap()][..], &args].concat(), &[]));
    assert_eq!(by_path.len(), 6);

    let cache = tempfile::tempdir().unwrap();
    hub_cache(cache.path());
    let env = [("HF_HUB_CACHE", cache.path())];
    let by_id = tokens(&host(&[&["run", "--model", "test/dense"][..], &args].concat(), &env));
    assert_eq!(by_id, by_path);
    let pinned =
        host(&[&["run", "-m", "test/dense@0123456789abcdef0123456789abcdef01234567"][..], &args].concat(), &env);
    assert_eq!(tokens(&pinned), by_path);

    // HF_HOME/hub is the next place looked in.
    let home = tempfile::tempdir().unwrap();
    hub_cache(&home.path().join("hub"));
    assert_eq!(
        tokens(&host(&[&["run", "--model", "test/dense"][..], &args].concat(), &[("HF_HOME", home.path())])),
        by_path
    );

    let miss = host(&["run", "--model", "test/absent", "--prompt-ids", "2"], &env);
    assert!(!miss.status.success());
    let stderr = text(&miss.stderr);
    assert!(stderr.contains("model `test/absent` not found") && stderr.contains("models--test--absent"), "{stderr}");
}

#[test]
fn a_manifests_model_may_be_an_id_and_flags_add_a_drafter() {
    let cache = tempfile::tempdir().unwrap();
    hub_cache(cache.path());
    let work = tempfile::tempdir().unwrap();
    let manifest = work.path().join("m.toml");
    fs::write(&manifest, "[target]\nmodel = \"test/dense\"\n[generation]\nprompt_ids = [2, 17, 40]\nmax_tokens = 8\n")
        .unwrap();
    let env = [("HF_HUB_CACHE", cache.path())];
    let plain = tokens(&host(&["run", "--manifest", manifest.to_str().unwrap(), "--temperature", "0", "--json"], &env));
    let plugins = plugins_dir_with(&[&workspace_plugin("ngram")]);
    let args = ["run", "--manifest", manifest.to_str().unwrap(), "--temperature", "0", "--json", "--drafter", "ngram"];
    let out = host(&[&args[..], &["--plugins-dir", plugins.path().to_str().unwrap()]].concat(), &env);
    assert_eq!(tokens(&out), plain, "speculation changes nothing but speed");
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(json["stats"]["rounds"].as_u64().unwrap() > 0);
}

#[test]
fn the_version_names_the_plugin_api_and_mlx() {
    let out = host(&["--version"], &[]);
    let line = text(&out.stdout);
    assert!(line.starts_with(&format!("host {}", env!("CARGO_PKG_VERSION"))), "{line}");
    assert!(line.contains(&format!("plugin API {}", plugin_api::API_VERSION)) && line.contains("MLX 0."), "{line}");
}

#[test]
fn completion_scripts_for_the_common_shells() {
    for (shell, marker) in [("bash", "_host()"), ("zsh", "#compdef host"), ("fish", "complete -c host")] {
        let out = host(&["completions", shell], &[]);
        assert!(out.status.success() && text(&out.stdout).contains(marker), "{shell}");
    }
}

#[test]
fn a_prompts_file_runs_as_one_batch_in_input_order_and_bad_lines_do_not_stop_it() {
    let work = tempfile::tempdir().unwrap();
    let file = work.path().join("in.jsonl");
    let lines = [
        r#"{"id": "a", "prompt_ids": [2, 17, 40], "max_tokens": 7, "logprobs": 1}"#,
        r#"{"id": 2, "prompt_ids": [2, 5, 9, 61], "max_tokens": 5, "frequency_penalty": 1.5, "logit_bias": {"9": -3}}"#,
        "this is not json",
        "",
        r#"{"prompt_ids": [2, 99999]}"#,
        r#"{"prompt_ids": [2, 33], "max_tokens": 4, "colour": "red"}"#,
        r#"{"prompt_ids": [2, 33, 7], "max_tokens": 6}"#,
    ];
    fs::write(&file, lines.join("\n")).unwrap();
    let dense = dense();
    let plugins = plugins_dir_with(&[&workspace_plugin("ngram")]);
    let alone = |ids: &str, n: &str, extra: &[&str]| {
        let model = dense.to_str().unwrap();
        let args = ["run", "--model", model, "--prompt-ids", ids, "--max-tokens", n, "--temperature", "0", "--json"];
        tokens(&host(&[&args[..], extra].concat(), &[]))
    };
    let penalized = ["--frequency-penalty", "1.5", "--logit-bias", "9=-3"];
    let expected = [alone("2,17,40", "7", &[]), alone("2,5,9,61", "5", &penalized), alone("2,33,7", "6", &[])];
    assert_ne!(expected[1], alone("2,5,9,61", "5", &[]), "the line's penalties change its output");
    for drafter in [None, Some("ngram")] {
        let out_file = work.path().join("out.jsonl");
        let mut args = vec!["run", "--model", dense.to_str().unwrap(), "--temperature", "0", "--prompts-file"];
        args.extend([file.to_str().unwrap(), "--output", out_file.to_str().unwrap()]);
        args.extend(["--plugins-dir", plugins.path().to_str().unwrap()]);
        if let Some(kind) = drafter {
            args.extend(["--drafter", kind]);
        }
        let out = host(&args, &[]);
        assert!(out.status.success(), "{}", text(&out.stderr));
        assert!(text(&out.stderr).contains("6 requests, 3 failed"), "{}", text(&out.stderr));
        let results: Vec<serde_json::Value> =
            fs::read_to_string(&out_file).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        let lines: Vec<u64> = results.iter().map(|r| r["line"].as_u64().unwrap()).collect();
        assert_eq!(lines, [1, 2, 3, 5, 6, 7], "{drafter:?}");
        assert_eq!((&results[0]["id"], &results[1]["id"]), (&serde_json::json!("a"), &serde_json::json!(2)));
        let logprobs = results[0]["logprobs"].as_array().unwrap();
        assert_eq!(logprobs.len(), 7, "{}", results[0]);
        assert!(logprobs.iter().all(|l| l["top"].as_array().unwrap().len() == 1), "{}", results[0]);
        assert!(results[1].get("logprobs").is_none(), "only the line that asks gets them");
        for (result, expected) in [&results[0], &results[1], &results[5]].into_iter().zip(&expected) {
            let got: Vec<u64> = result["tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap()).collect();
            assert_eq!(&got, expected, "{drafter:?}: each row equals its single run");
        }
        assert!(results[2]["error"].as_str().unwrap().starts_with("not a request"), "{}", results[2]);
        assert!(results[3]["error"].as_str().unwrap().contains("outside the vocabulary"), "{}", results[3]);
        assert!(results[4]["error"].as_str().unwrap().contains("unknown field `colour`"), "{}", results[4]);
    }
}

#[test]
fn stats_print_as_a_table() {
    let plugins = plugins_dir_with(&[&workspace_plugin("ngram")]);
    let dense = dense();
    let args = ["run", "--model", dense.to_str().unwrap(), "--drafter", "ngram", "--prompt-ids", "2,17,40,9,17,40"];
    let out = host(
        &[&args[..], &["--max-tokens", "12", "--stats", "--plugins-dir", plugins.path().to_str().unwrap()]].concat(),
        &[],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let table = text(&out.stderr);
    for row in ["generated tokens       12", "target forwards", "tokens per round (τ)", "accepted at draft 1"] {
        assert!(table.contains(row), "{row}: {table}");
    }
}

#[test]
fn quiet_leaves_only_the_output_and_verbose_works_in_every_subcommand() {
    let dense = dense();
    let args = ["run", "--model", dense.to_str().unwrap(), "--prompt-ids", "2,17,40", "--max-tokens", "4"];
    let loud = host(&args, &[]);
    assert!(text(&loud.stderr).contains("generated"), "the summary: {}", text(&loud.stderr));
    for quiet in ["-q", "--quiet"] {
        let out = host(&[&args[..], &[quiet]].concat(), &[]);
        assert!(out.status.success() && out.stderr.is_empty(), "{quiet}: {}", text(&out.stderr));
        assert_eq!(out.stdout, loud.stdout);
    }
    let refused = host(&["-q", "run", "--model", "/nonexistent", "--prompt-ids", "2"], &[]);
    assert!(!refused.status.success() && text(&refused.stderr).contains("error:"), "errors still show");
    for command in [&["plugins", "list"][..], &["doctor"], &["-v", "plugins", "list"]] {
        let out = host(&[command, &["--verbose"]].concat(), &[]);
        assert!(out.status.success(), "{command:?}: {}", text(&out.stderr));
    }
}
