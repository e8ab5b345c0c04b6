//! The command line as a user meets it: plugins dropped into a directory show up, refusals are
//! one line, manifests are checked against the plugin they name.

mod common;

use std::fs;
use std::process::{Command, Output};

use common::{fixture, plugins_dir_with, workspace_plugin};

fn host(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_host")).args(args).env("RUST_BACKTRACE", "0").output().unwrap()
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn a_plugin_copied_into_a_directory_shows_up_in_the_list() {
    let dir = plugins_dir_with(&[&workspace_plugin("ngram"), &fixture("future_api")]);
    let dir_arg = dir.path().to_str().unwrap();
    let out = host(&["plugins", "list", "--plugins-dir", dir_arg]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    let ngram = text.lines().find(|l| l.contains("libngram.so")).unwrap();
    assert!(
        ngram.contains("ngram")
            && ngram.contains(&format!("api {}", plugin_api::API_VERSION))
            && ngram.contains("loaded"),
        "{text}"
    );
    let future = text.lines().find(|l| l.contains("libfuture_api.so")).unwrap();
    assert!(future.contains("refused") && future.contains("built for plugin API 2.0.0"), "{text}");

    let out = host(&["plugins", "list", "--json", "--plugins-dir", dir_arg]);
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let plugins = json["plugins"].as_array().unwrap();
    assert_eq!(plugins.len(), 2);
    let ngram = plugins.iter().find(|p| p["status"] == "loaded").unwrap();
    assert_eq!((ngram["kind"].as_str(), ngram["api_version"].as_str()), (Some("ngram"), Some(plugin_api::API_VERSION)));
    assert!(ngram["version"].as_str().is_some());
    let refused = plugins.iter().find(|p| p["status"] == "refused").unwrap();
    assert!(refused["reason"].as_str().unwrap().starts_with("built for plugin API 2.0.0"));
}

#[test]
fn the_workspace_plugins_are_found_next_to_the_host_by_default() {
    let out = Command::new(env!("CARGO_BIN_EXE_host"))
        .args(["plugins", "list"])
        .env_remove("HOST_PLUGINS_DIR")
        .output()
        .unwrap();
    assert!(stdout(&out).lines().any(|l| l.contains("libngram.so") && l.contains("loaded")), "{}", stdout(&out));
}

#[test]
fn inspect_by_kind_and_by_path() {
    let dir = plugins_dir_with(&[&workspace_plugin("ngram")]);
    let out = host(&["plugins", "inspect", "ngram", "--json", "--plugins-dir", dir.path().to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json["kind"], "ngram");
    let keys: Vec<&str> = json["options"].as_array().unwrap().iter().map(|o| o["key"].as_str().unwrap()).collect();
    assert_eq!(keys, ["max_ngram", "min_ngram"]);

    let bad = fixture("abi_mismatch");
    let out = host(&["plugins", "inspect", bad.to_str().unwrap()]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains(&format!("ABI layout mismatch with plugin API {}: mismatched package", plugin_api::API_VERSION)),
        "{err}"
    );
    let verbose = host(&["plugins", "inspect", bad.to_str().unwrap(), "--verbose"]);
    assert!(stderr(&verbose).lines().count() > 10);

    let out = host(&["plugins", "inspect", "nope", "--plugins-dir", dir.path().to_str().unwrap()]);
    assert!(stderr(&out).contains("no plugin of kind `nope`"), "{}", stderr(&out));
}

#[test]
fn manifest_check_loads_and_configures_the_drafter() {
    let plugins = plugins_dir_with(&[&workspace_plugin("ngram")]);
    let work = tempfile::tempdir().unwrap();
    fs::create_dir(work.path().join("model")).unwrap();
    fs::write(work.path().join("model/config.json"), "{}").unwrap(); // a checkpoint, as far as manifests look
    let manifest = work.path().join("m.toml");
    let check = |text: &str| {
        fs::write(&manifest, text).unwrap();
        host(&["manifest", "check", manifest.to_str().unwrap(), "--plugins-dir", plugins.path().to_str().unwrap()])
    };

    let ok = check("[target]\nmodel = \"model\"\n[drafter]\nkind = \"ngram\"\n[drafter.options]\nmax_ngram = 4\n");
    assert!(ok.status.success(), "{}", stderr(&ok));
    assert!(stdout(&ok).contains("drafter   ngram"), "{}", stdout(&ok));

    let unknown =
        check("[target]\nmodel = \"model\"\n[drafter]\nkind = \"ngram\"\n[drafter.options]\nmax_ngramm = 4\n");
    let err = stderr(&unknown);
    assert!(
        err.contains(
            "m.toml:6: drafter.options.max_ngramm: unknown option for drafter `ngram` (known: max_ngram, min_ngram)"
        ),
        "{err}"
    );

    let bad_value =
        check("[target]\nmodel = \"model\"\n[drafter]\nkind = \"ngram\"\n[drafter.options]\nmax_ngram = \"four\"\n");
    assert!(stderr(&bad_value).contains("invalid options: option `max_ngram`"), "{}", stderr(&bad_value));

    let pinned = check("[target]\nmodel = \"model\"\n[drafter]\nkind = \"ngram\"\nsha256 = \"0000000000000000000000000000000000000000000000000000000000000000\"\n");
    assert!(
        stderr(&pinned).contains("no library in") && stderr(&pinned).contains("has the pinned sha256"),
        "{}",
        stderr(&pinned)
    );

    let missing_kind = check("[target]\nmodel = \"model\"\n[drafter]\nkind = \"dflash\"\n");
    let err = stderr(&missing_kind);
    assert!(err.contains("no plugin of kind `dflash`") && err.contains("(named by --plugins-dir)"), "{err}");
    assert!(err.contains("`plugins_dir` under the manifest's [drafter]"), "{err}");
}

/// A manifest names its plugins directory, relative to itself: it wins over $HOST_PLUGINS_DIR
/// and the executable's directory, `--plugins-dir` wins over it, and a missing one is refused
/// naming the key and line.
#[test]
fn a_manifest_names_its_plugins_directory() {
    let plugins = plugins_dir_with(&[&workspace_plugin("ngram")]);
    let empty = tempfile::tempdir().unwrap();
    let work = tempfile::tempdir().unwrap();
    fs::create_dir(work.path().join("model")).unwrap();
    fs::write(work.path().join("model/config.json"), "{}").unwrap(); // a checkpoint, as far as manifests look
    let manifest = work.path().join("m.toml");
    let relative = pathdiff(plugins.path(), work.path());
    let check = |plugins_dir: &str, flag: Option<&std::path::Path>| {
        let text =
            format!("[target]\nmodel = \"model\"\n[drafter]\nkind = \"ngram\"\nplugins_dir = \"{plugins_dir}\"\n");
        fs::write(&manifest, text).unwrap();
        let mut command = Command::new(env!("CARGO_BIN_EXE_host"));
        command.args(["manifest", "check", manifest.to_str().unwrap()]).env("HOST_PLUGINS_DIR", empty.path());
        if let Some(flag) = flag {
            command.arg("--plugins-dir").arg(flag);
        }
        command.output().unwrap()
    };
    let found = check(&relative, None);
    assert!(found.status.success(), "{}", stderr(&found));
    let overridden = check(&relative, Some(empty.path()));
    assert!(stderr(&overridden).contains("no plugin of kind `ngram`"), "{}", stderr(&overridden));
    let missing = check("nowhere", None);
    let err = stderr(&missing);
    assert!(err.contains("m.toml:5: drafter.plugins_dir:") && err.contains("does not exist"), "{err}");
}

/// `to` relative to `from` (both absolute): up to their common ancestor, then down.
fn pathdiff(to: &std::path::Path, from: &std::path::Path) -> String {
    let (to, from): (Vec<_>, Vec<_>) = (to.components().collect(), from.components().collect());
    let common = to.iter().zip(&from).take_while(|(a, b)| a == b).count();
    let up = std::iter::repeat_n("..".to_owned(), from.len() - common);
    let down = to[common..].iter().map(|c| c.as_os_str().to_string_lossy().into_owned());
    up.chain(down).collect::<Vec<_>>().join("/")
}

fn dense_manifest(dir: &std::path::Path, drafter: &str) -> std::path::PathBuf {
    let model =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/gemma4/dense").canonicalize().unwrap();
    let file = dir.join("m.toml");
    fs::write(
        &file,
        format!(
            "[target]\nmodel = \"{}\"\n{drafter}[generation]\nprompt = \"So she was considering\"\nmax_tokens = 40\n",
            model.display()
        ),
    )
    .unwrap();
    file
}

fn run_json(args: &[&str]) -> serde_json::Value {
    let out = host(args);
    assert!(out.status.success(), "{}", stderr(&out));
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn run_prints_the_contracts_json_and_speculation_changes_nothing_but_speed() {
    let work = tempfile::tempdir().unwrap();
    let plain = dense_manifest(work.path(), "");
    let plain = run_json(&["run", "--manifest", plain.to_str().unwrap(), "--temperature", "0", "--json"]);
    let tokens = plain["tokens"].as_array().unwrap();
    assert!(!tokens.is_empty() && tokens.len() <= 40);
    for key in [
        "generated_tokens",
        "drafted",
        "accepted",
        "rounds",
        "target_forwards",
        "mean_accept_len",
        "acceptance_rate",
        "accepted_by_position",
        "prefill_ms",
        "decode_ms",
        "decode_tokens_per_s",
        "draft_ms",
        "verify_ms",
    ] {
        assert!(plain["stats"].get(key).is_some(), "stats lack `{key}`: {}", plain["stats"]);
    }
    assert!(plain["text"].is_string());
    // Streaming writes exactly the text the JSON reports (and a final newline).
    let plain_file = work.path().join("m.toml");
    let streamed = host(&["run", "--manifest", plain_file.to_str().unwrap(), "--temperature", "0"]);
    assert!(streamed.status.success(), "{}", stderr(&streamed));
    assert_eq!(stdout(&streamed), format!("{}\n", plain["text"].as_str().unwrap()));

    let spec_dir = tempfile::tempdir().unwrap();
    let spec = dense_manifest(spec_dir.path(), "[drafter]\nkind = \"ngram\"\ndraft_tokens = 3\n");
    let spec = run_json(&["run", "--manifest", spec.to_str().unwrap(), "--temperature", "0", "--json"]);
    assert_eq!(spec["tokens"], plain["tokens"]);
    assert_eq!(spec["text"], plain["text"]);
    assert!(spec["stats"]["rounds"].as_u64().unwrap() > 0);
    let spec_file = spec_dir.path().join("m.toml");
    let streamed = host(&["run", "--manifest", spec_file.to_str().unwrap(), "--temperature", "0"]);
    assert_eq!(stdout(&streamed), format!("{}\n", spec["text"].as_str().unwrap()));
    // --compare-plain decodes the request plainly too and says where the outputs part, if they do.
    let compared = run_json(&[
        "run",
        "--manifest",
        spec_file.to_str().unwrap(),
        "--temperature",
        "0",
        "--json",
        "--compare-plain",
    ]);
    let comparison = &compared["plain"];
    assert_eq!((&comparison["identical"], &comparison["first_difference"]), (&true.into(), &serde_json::Value::Null));
    assert!(comparison["speedup"].as_f64().unwrap() > 0.0, "{comparison}");

    // Prompt ids on the command line override the manifest's prompt; sampling with a seed is
    // reproducible.
    let ids = [
        "run",
        "--manifest",
        spec_file.to_str().unwrap(),
        "--prompt-ids",
        "2,40,41,42",
        "--temperature",
        "0.8",
        "--seed",
        "4",
        "--json",
    ];
    let sampled = run_json(&ids);
    assert_eq!(sampled["stats"]["prompt_tokens"], 4, "the manifest's prompt was used: {}", sampled["stats"]);
    assert_eq!(sampled["tokens"], run_json(&ids)["tokens"]);
}

#[test]
fn run_refuses_bad_input_in_one_line() {
    let work = tempfile::tempdir().unwrap();
    let file = dense_manifest(work.path(), "[drafter]\nkind = \"nope\"\n");
    let out = host(&["run", "--manifest", file.to_str().unwrap()]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("no plugin of kind `nope`"), "{}", stderr(&out));

    let file = dense_manifest(work.path(), "");
    let out = host(&["run", "--manifest", file.to_str().unwrap(), "--prompt-ids", "2,99999"]);
    assert!(
        stderr(&out).contains("prompt token id 99999 (at position 1) is outside the vocabulary of 512"),
        "{}",
        stderr(&out)
    );
    let out = host(&["run", "--manifest", file.to_str().unwrap(), "--top-p", "1.5"]);
    assert!(stderr(&out).contains("top_p must be in (0, 1] (1 = off), got 1.5"), "{}", stderr(&out));
}

#[test]
fn draft_tokens_from_the_command_line_are_validated_like_the_manifests() {
    let work = tempfile::tempdir().unwrap();
    let file = dense_manifest(work.path(), "[drafter]\nkind = \"ngram\"\n");
    let out = host(&["run", "--manifest", file.to_str().unwrap(), "--draft-tokens", "0"]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("--draft-tokens: must be 1 to 64, got 0"), "{}", stderr(&out));
    for n in ["65", "4294967295"] {
        let out = host(&["run", "--manifest", file.to_str().unwrap(), "--draft-tokens", n]);
        assert!(stderr(&out).contains(&format!("--draft-tokens: must be 1 to 64, got {n}")), "{}", stderr(&out));
    }
}

#[test]
fn plain_bench_without_mlx_lm_names_the_option_and_the_variable() {
    let work = tempfile::tempdir().unwrap();
    let file = dense_manifest(work.path(), "");
    let out = Command::new(env!("CARGO_BIN_EXE_host"))
        .args(["bench", "--manifest", file.to_str().unwrap(), "--pairs", "1"])
        .env_remove("HOST_MLX_LM_PYTHON")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(err.contains("--mlx-lm-python") && err.contains("HOST_MLX_LM_PYTHON"), "{err}");
}

#[test]
fn plain_bench_against_llama_cpp_needs_both_its_binary_and_a_gguf_and_names_a_failing_one() {
    let work = tempfile::tempdir().unwrap();
    let file = dense_manifest(work.path(), "");
    let manifest = file.to_str().unwrap();
    let out = host(&["bench", "--manifest", manifest, "--llama-bench", "/bin/true"]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("--gguf"), "{}", stderr(&out));
    // A llama-bench that prints no JSON array: refused, naming the command and what was wrong.
    let gguf = work.path().join("m.gguf");
    fs::write(&gguf, b"GGUF").unwrap();
    let args = ["bench", "--manifest", manifest, "--pairs", "1", "--max-tokens", "4", "--prompt-tokens", "8"];
    let out = host(&[&args[..], &["--llama-bench", "/bin/true", "--gguf", gguf.to_str().unwrap()]].concat());
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(err.contains("/bin/true -m") && err.contains("not llama-bench's JSON array"), "{err}");
    let out =
        host(&[&args[..], &["--llama-bench", "/nonexistent/llama-bench", "--gguf", gguf.to_str().unwrap()]].concat());
    assert!(stderr(&out).contains("/nonexistent/llama-bench"), "{}", stderr(&out));
}

#[test]
fn loop_choices_that_name_nothing_are_refused_at_start() {
    for (variable, value, expected) in [
        ("HOST_SIMD", "sse4", "HOST_SIMD=\"sse4\" is not a route; use auto, avx512, avx512-nobf16, avx2 or portable"),
        (
            "HOST_QUANTIZED_ACTIVATIONS",
            "int4",
            "HOST_QUANTIZED_ACTIVATIONS=\"int4\" is not a choice; use float or int8",
        ),
    ] {
        let out =
            Command::new(env!("CARGO_BIN_EXE_host")).args(["plugins", "list"]).env(variable, value).output().unwrap();
        assert_eq!(out.status.code(), Some(1), "{variable}");
        assert!(stderr(&out).contains(expected), "{}", stderr(&out));
    }
    let out = Command::new(env!("CARGO_BIN_EXE_host")).args(["doctor"]).env("HOST_SIMD", "portable").output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains("loops:       portable (HOST_SIMD=portable)"), "{}", stdout(&out));
}

#[test]
fn a_draft_length_beyond_the_drafters_limit_is_warned_about() {
    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/deepspec/gemma4-dense");
    let work = tempfile::tempdir().unwrap();
    let file = work.path().join("m.toml");
    fs::write(
        &file,
        format!(
            "[target]\nmodel = \"{}\"\n[drafter]\nkind = \"deepspec\"\nartifact = \"{}\"\ndraft_tokens = 8\n",
            fixture.join("target").display(),
            fixture.join("drafter").display()
        ),
    )
    .unwrap();
    let out = host(&["manifest", "check", file.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains("draft_tokens = 8 exceeds the drafter's max_draft_tokens of"), "{}", stdout(&out));
    let out = host(&["run", "--manifest", file.to_str().unwrap(), "--prompt-ids", "2,5,6", "--max-tokens", "2"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stderr(&out).contains("warning: draft_tokens = 8 exceeds"), "{}", stderr(&out));
}

#[test]
fn a_drafter_calling_a_port_it_did_not_declare_is_refused_naming_it() {
    // ngram declares no ports; the host's view of the target refuses what was not declared.
    host::runtime::init();
    let model = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/gemma4/dense");
    let model = std::rc::Rc::new(host::model::load(&model).unwrap());
    let caches = std::rc::Rc::new(std::cell::RefCell::new(Vec::new()));
    let view = host::target_view::TargetView::new(model, caches, plugin_api::Ports::EMBED);
    use plugin_api::target::TargetViewAbi;
    let error = view.read_donors().into_result().err().unwrap();
    assert!(
        error.message.contains("`donors` port was not declared") && error.message.contains("declared: embed"),
        "{error}"
    );
}

#[test]
fn ambiguous_or_out_of_range_requests_are_refused_naming_the_option() {
    let work = tempfile::tempdir().unwrap();
    let file = dense_manifest(work.path(), "");
    let m = file.to_str().unwrap();
    let cases: [(&[&str], &str); 5] = [
        (&["--top-p", "0"], "top_p must be in (0, 1] (1 = off), got 0"),
        (&["--chat", "--prompt-ids", "2,5"], "'--chat' cannot be used with '--prompt-ids"),
        (&["--temperature", "-1"], "temperature must be a finite number >= 0, got -1"),
        (&["--max-tokens", "-1"], "invalid value '-1' for '--max-tokens"),
        (&["--seed", "-5"], "invalid value '-5' for '--seed"),
    ];
    for (args, expected) in cases {
        let mut all = vec!["run", "--manifest", m];
        all.extend_from_slice(args);
        let out = host(&all);
        assert!(!out.status.success() && stderr(&out).contains(expected), "{args:?}: {}", stderr(&out));
    }
    let both = work.path().join("both.toml");
    let text = fs::read_to_string(&file).unwrap().replace("[generation]\n", "[generation]\nprompt_ids = [2, 5]\n");
    fs::write(&both, text).unwrap();
    let out = host(&["run", "--manifest", both.to_str().unwrap()]);
    assert!(stderr(&out).contains("give `prompt` or `prompt_ids`, not both"), "{}", stderr(&out));
    let deep = work.path().join("deep.toml");
    fs::write(
        &deep,
        fs::read_to_string(&file)
            .unwrap()
            .replace("[generation]", "[drafter]\nkind = \"ngram\"\ndraft_tokens = 100000\n[generation]"),
    )
    .unwrap();
    let out = host(&["run", "--manifest", deep.to_str().unwrap()]);
    assert!(stderr(&out).contains("drafter.draft_tokens: must be 1 to 64 or \"auto\", got 100000"), "{}", stderr(&out));
}

/// `bench --sweep --equal-width-trees`: each drafter at each length as a chain and as a tree of
/// as many drafts, both giving plain decoding's tokens, the trees' rows named apart; the plot
/// draws both.
#[test]
fn a_sweep_times_chains_and_trees_of_equal_width() {
    let work = tempfile::tempdir().unwrap();
    let prompts = work.path().join("prompts.jsonl");
    fs::write(
        &prompts,
        "{\"prompt\": \"And God said, Let there be light\"}\n{\"prompt\": \"The LORD is my shepherd\"}\n",
    )
    .unwrap();
    let manifest = concat!(env!("CARGO_MANIFEST_DIR"), "/../manifests/demo-lookup.toml");
    let plot = work.path().join("sweep.png");
    let args = [
        "bench",
        "--sweep",
        manifest,
        "--prompts-file",
        prompts.to_str().unwrap(),
        "--draft-tokens",
        "3",
        "--max-tokens",
        "24",
        "--equal-width-trees",
        "--plot",
        plot.to_str().unwrap(),
        "--json",
    ];
    let out = host(&args);
    assert!(out.status.success(), "{}", stderr(&out));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let rows = report["rows"].as_array().unwrap();
    let shapes: Vec<(&str, u64)> =
        rows.iter().map(|r| (r["drafter"].as_str().unwrap(), r["tree_nodes"].as_u64().unwrap())).collect();
    assert_eq!(shapes, [("demo-lookup", 0), ("demo-lookup trees", 3)], "{report}");
    for row in rows {
        assert_eq!(row["identical"], 2, "{row}");
        assert!(row["tau"].as_f64().unwrap() > 1.0, "{row}");
    }
    assert!(fs::metadata(&plot).unwrap().len() > 0);
}
