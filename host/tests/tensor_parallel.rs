//! The target sharded over two ranks on loopback (MLX's ring backend) against one process: the
//! same logits up to summation order, the same greedy tokens, speculation on top equal to plain
//! decoding, refused shapes named, and a dead rank that ends the run instead of hanging it.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use host::distributed::{HOSTFILE_ENV, RANK_ENV};
use host::model::Gemma4;
use kernels::os::processes::{self, Signal};
use mlx_rs::{Array, Dtype};

const MODEL_ENV: &str = "TENSOR_PARALLEL_TEST_MODEL";
const LOGITS_ENV: &str = "TENSOR_PARALLEL_TEST_LOGITS";
const PROMPT: [i32; 9] = [2, 17, 90, 301, 44, 5, 128, 77, 3];

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/gemma4").join(name)
}

fn host(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_host")).args(args).env("RUST_BACKTRACE", "0").output().unwrap()
}

/// Logits of the prompt in one forward, then of one decode step after it, flattened.
fn prompt_and_step_logits(model: &Gemma4) -> Vec<f32> {
    let mut caches = model.make_caches(1, 0);
    let mut all = Vec::new();
    for ids in [&PROMPT[..], &[42]] {
        let ids = Array::from_slice(ids, &[1, ids.len() as i32]);
        let h = model.forward_hidden(&ids, &mut caches, None).unwrap();
        let logits = model.logits_from_hidden(&h).unwrap().as_dtype(Dtype::Float32).unwrap();
        all.extend_from_slice(logits.as_slice::<f32>());
    }
    all
}

/// The body of one rank, started by `two_ranks_compute_one_processs_logits` with the ring's
/// environment: rank 0 writes the bytes of weights it holds, then the logits it computed.
#[test]
#[ignore = "a rank of two_ranks_compute_one_processs_logits, started by it"]
fn rank_writes_its_logits() {
    host::runtime::init();
    let dir = std::env::var(MODEL_ENV).expect("only two_ranks_compute_one_processs_logits starts this rank");
    let model = host::model::load(Path::new(&dir)).unwrap();
    let group = model.group.expect("started as a rank of two");
    let logits = prompt_and_step_logits(&model);
    if group.rank == 0 {
        let mut bytes: Vec<u8> = (model.weight_bytes as u64).to_le_bytes().to_vec();
        bytes.extend(logits.iter().flat_map(|v| v.to_le_bytes()));
        std::fs::write(std::env::var(LOGITS_ENV).unwrap(), bytes).unwrap();
    }
}

fn ring_hostfile(dir: &Path, ranks: usize) -> PathBuf {
    let listeners: Vec<TcpListener> = (0..ranks).map(|_| TcpListener::bind("127.0.0.1:0").unwrap()).collect();
    let addresses: Vec<Vec<String>> = listeners.iter().map(|l| vec![l.local_addr().unwrap().to_string()]).collect();
    let file = dir.join("hosts.json");
    std::fs::write(&file, serde_json::to_string(&addresses).unwrap()).unwrap();
    file
}

/// Rank 0's weight bytes and logits.
fn logits_on_two_ranks(model: &Path) -> (usize, Vec<f32>) {
    let dir = tempfile::tempdir().unwrap();
    let hostfile = ring_hostfile(dir.path(), 2);
    let out = dir.path().join("logits.f32");
    let mut ranks: Vec<_> = (0..2)
        .map(|rank| {
            Command::new(std::env::current_exe().unwrap())
                .args(["--exact", "rank_writes_its_logits", "--ignored", "--nocapture", "--test-threads", "1"])
                .env(RANK_ENV, rank.to_string())
                .env(HOSTFILE_ENV, &hostfile)
                .env(MODEL_ENV, model)
                .env(LOGITS_ENV, &out)
                .stdout(Stdio::null())
                .spawn()
                .unwrap()
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(120);
    for rank in &mut ranks {
        loop {
            if let Some(status) = rank.try_wait().unwrap() {
                assert!(status.success(), "a rank failed: {status}");
                break;
            }
            assert!(Instant::now() < deadline, "the ranks did not finish in 120 s");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    let bytes = std::fs::read(&out).unwrap();
    let (held, logits) = bytes.split_at(8);
    let logits = logits.chunks(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect();
    (u64::from_le_bytes(held.try_into().unwrap()) as usize, logits)
}

/// The quant4 fixture with its bfloat16 tensors (scales, biases, norms) widened to float32, so
/// that its activations are float32. With half-precision activations each rank's partial sum is
/// rounded to that precision before the ranks add them, which no summation order undoes: sharded
/// bfloat16 logits agree with one process's only to bfloat16 precision.
fn quant4_in_float32() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(fixture("quant4")).unwrap() {
        let path = entry.unwrap().path();
        let target = dir.path().join(path.file_name().unwrap());
        if path.extension().is_none_or(|e| e != "safetensors") {
            std::fs::copy(&path, target).unwrap();
            continue;
        }
        let bytes = std::fs::read(&path).unwrap();
        let tensors = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let widened: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = tensors
            .tensors()
            .into_iter()
            .map(|(name, view)| match view.dtype() {
                safetensors::Dtype::BF16 => {
                    let data = view.data().chunks(2).flat_map(|b| [0, 0, b[0], b[1]]).collect();
                    (name, safetensors::Dtype::F32, view.shape().to_vec(), data)
                }
                dtype => (name, dtype, view.shape().to_vec(), view.data().to_vec()),
            })
            .collect();
        let views: Vec<(String, safetensors::tensor::TensorView)> = widened
            .iter()
            .map(|(name, dtype, shape, data)| {
                (name.clone(), safetensors::tensor::TensorView::new(*dtype, shape.clone(), data).unwrap())
            })
            .collect();
        safetensors::serialize_to_file(views, &None, &target).unwrap();
    }
    dir
}

#[test]
fn two_ranks_compute_one_processs_logits() {
    host::runtime::init();
    let quant4 = quant4_in_float32();
    for (name, dir) in [("dense", fixture("dense")), ("moe", fixture("moe")), ("quant4", quant4.path().to_owned())] {
        let model = host::model::load::load_on(&dir, None).unwrap();
        let whole = prompt_and_step_logits(&model);
        let (held, sharded) = logits_on_two_ranks(&dir);
        // Only norms (and the router) are held whole: a rank loads little more than half.
        assert!(held * 100 <= model.weight_bytes * 55, "{name}: rank 0 holds {held} of {} bytes", model.weight_bytes);
        assert_eq!(whole.len(), sharded.len(), "{name}");
        let worst = whole.iter().zip(&sharded).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(worst <= 1e-4, "{name}: logits differ by up to {worst}");
        assert!(whole.iter().any(|&v| v != 0.0), "{name}: the logits are all zero");
    }
}

fn tokens(out: &Output) -> Vec<u64> {
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    json["tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap()).collect()
}

fn launched(ranks: &str, args: &[&str]) -> Output {
    let mut all = vec!["launch", "-n", ranks, "--", "run"];
    all.extend_from_slice(args);
    host(&all)
}

#[test]
fn two_ranks_decode_one_processs_greedy_tokens() {
    let quant4 = quant4_in_float32();
    for (name, model) in [("dense", fixture("dense")), ("moe", fixture("moe")), ("quant4", quant4.path().to_owned())] {
        let args = ["--model", model.to_str().unwrap(), "--prompt-ids", "2,17,90,301,44", "--max-tokens", "24"];
        let args = [&args[..], &["--temperature", "0", "--json"]].concat();
        let alone = tokens(&host(&[&["run"][..], &args].concat()));
        assert_eq!(tokens(&launched("2", &args)), alone, "{name}");
        assert_eq!(alone.len(), 24);
    }
}

#[test]
fn ctrl_c_at_the_terminal_stops_every_rank_and_prints_what_rank_0_produced() {
    // The launcher in a group of its own, as a shell's foreground job: Ctrl-C goes to the group.
    let dense = fixture("dense");
    let mut command = Command::new(env!("CARGO_BIN_EXE_host"));
    command
        .args(["launch", "-n", "2", "--", "run", "--model", dense.to_str().unwrap(), "--prompt-ids", "2,17,40"])
        .args(["--max-tokens", "100000", "--temperature", "0", "--json"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let child = processes::in_own_group(&mut command).spawn().unwrap();
    std::thread::sleep(Duration::from_secs(4));
    assert!(processes::send_to_group(child.id(), Signal::Interrupt));
    let started = Instant::now();
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(130), "{err}");
    assert!(started.elapsed() < Duration::from_secs(10), "{:?}: {err}", started.elapsed());
    assert!(!err.contains("killed by signal") && !err.contains("rank 1"), "{err}");
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("rank 0's JSON");
    assert_eq!(json["stop"], "interrupted", "{json}");
    assert!(!json["tokens"].as_array().unwrap().is_empty(), "{json}");
}

#[test]
fn speculation_over_two_ranks_equals_plain_decoding() {
    // The DFlash fixture's drafter and the target it was made for.
    let pair = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/dflash/gemma4-dense");
    let (dense, dflash) = (pair.join("target"), pair.join("drafter"));
    let plugins = Path::new(env!("CARGO_BIN_EXE_host")).parent().unwrap().to_str().unwrap().to_owned();
    let base = ["--model", dense.to_str().unwrap(), "--prompt-ids", "2,17,90,301,44,2,17,90", "--max-tokens", "32"];
    for drafter in
        [vec!["--drafter", "ngram"], vec!["--drafter", "dflash", "--drafter-artifact", dflash.to_str().unwrap()]]
    {
        for sampling in [&["--temperature", "0"][..], &["--temperature", "0.8", "--seed", "7"]] {
            let args =
                [&base[..], &drafter, sampling, &["--draft-tokens", "3", "--json", "--plugins-dir", &plugins]].concat();
            let speculative = launched("2", &args);
            let alone = tokens(&host(&[&["run"][..], &base, sampling, &["--json"]].concat()));
            assert_eq!(tokens(&speculative), alone, "{drafter:?} {sampling:?}");
            let stats: serde_json::Value = serde_json::from_slice(&speculative.stdout).unwrap();
            assert!(stats["stats"]["drafted"].as_u64().unwrap() > 0, "{drafter:?}: nothing was drafted");
        }
    }
    // `draft_tokens = "auto"`: the ranks measure the forward together, take rank 0's figures
    // and choose every round's depth alike.
    let dir = tempfile::tempdir().unwrap();
    let manifest = dir.path().join("auto.toml");
    let text = format!("[target]\nmodel = {dense:?}\n\n[drafter]\nkind = \"ngram\"\ndraft_tokens = \"auto\"\n");
    std::fs::write(&manifest, text).unwrap();
    let greedy = ["--temperature", "0", "--json"];
    let args = [&base[2..], &greedy, &["--manifest", manifest.to_str().unwrap(), "--plugins-dir", &plugins]].concat();
    let alone = tokens(&host(&[&["run"][..], &base, &greedy].concat()));
    assert_eq!(tokens(&launched("2", &args)), alone);
}

#[test]
fn shapes_that_do_not_divide_among_the_ranks_are_refused_by_name() {
    let out = launched("2", &["--model", fixture("ple-kvshare").to_str().unwrap(), "--prompt-ids", "1,2"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("num_key_value_heads (layer 0) = 1 does not divide among 2 ranks"), "{err}");
    let out = launched("3", &["--model", fixture("dense").to_str().unwrap(), "--prompt-ids", "1,2"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("num_attention_heads = 4 does not divide among 3 ranks"), "{err}");
}

#[test]
fn a_drafter_that_reads_the_targets_kv_heads_is_refused() {
    let pair = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/assistant/tied");
    let plugins = Path::new(env!("CARGO_BIN_EXE_host")).parent().unwrap().to_str().unwrap().to_owned();
    let (target, assistant) = (pair.join("target"), pair.join("assistant"));
    let args = ["--model", target.to_str().unwrap(), "--drafter", "assistant", "--prompt-ids", "1,2"];
    let out = launched(
        "2",
        &[&args[..], &["--drafter-artifact", assistant.to_str().unwrap(), "--plugins-dir", &plugins]].concat(),
    );
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("drafter `assistant` cannot serve this target: it reads the target's KV caches"), "{err}");
}

#[test]
fn a_rank_that_dies_ends_the_others_with_a_message() {
    let model = fixture("dense");
    let mut launcher = Command::new(env!("CARGO_BIN_EXE_host"))
        .args(["launch", "-n", "2", "--", "run", "--model", model.to_str().unwrap()])
        .args(["--prompt-ids", "1,2", "--max-tokens", "100000", "--temperature", "0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Both ranks are decoding once the first token is out. The run is short (it meets <eos>
    // after a few hundred tokens, about a second here), so rank 1 dies right then.
    let mut stdout = launcher.stdout.take().unwrap();
    let (first_token, decoding) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut byte = [0u8; 1];
        if std::io::Read::read(&mut stdout, &mut byte).unwrap_or(0) > 0 {
            let _ = first_token.send(());
        }
        let _ = std::io::copy(&mut stdout, &mut std::io::sink());
    });
    decoding.recv_timeout(Duration::from_secs(30)).expect("no token within 30 s");
    let start = Instant::now();
    let ranks = loop {
        let ranks = processes::children(launcher.id());
        if ranks.len() == 2 {
            break ranks;
        }
        assert!(start.elapsed() < Duration::from_secs(30), "the ranks did not start");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(processes::send(ranks[1], Signal::Kill));
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = launcher.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            launcher.kill().unwrap();
            panic!("the launcher still runs 30 s after rank 1 died");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(!status.success());
    let mut err = String::new();
    std::io::Read::read_to_string(&mut launcher.stderr.take().unwrap(), &mut err).unwrap();
    assert!(err.contains("rank 1 (killed by signal 9); the other ranks were stopped"), "{err}");
    assert!(!processes::is_running(ranks[0]), "rank 0 outlived the launcher");
}

#[test]
fn the_sharded_bench_pairs_one_process_with_the_ranks() {
    let dir = tempfile::tempdir().unwrap();
    let manifest = dir.path().join("m.toml");
    let target = fixture("dense");
    let text = format!("[target]\nmodel = {:?}\n\n[generation]\nprompt_ids = [2, 17, 90]\n", target.to_str().unwrap());
    std::fs::write(&manifest, text).unwrap();
    let out = host(&[
        "bench",
        "--manifest",
        manifest.to_str().unwrap(),
        "--ranks",
        "2",
        "--pairs",
        "2",
        "--max-tokens",
        "8",
        "--json",
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["identical_tokens"], true);
    assert_eq!(report["ratios"].as_array().unwrap().len(), 2);
    assert!(report["sharded"].as_array().unwrap().iter().all(|r| r.as_f64().unwrap() > 0.0));

    let out = host(&["launch", "-n", "2", "--", "bench", "--collectives", "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let rows = report["rows"].as_array().unwrap();
    assert!(rows.len() >= 2 && rows.iter().all(|r| r["median_us"].as_f64().unwrap() > 0.0), "{report}");

    let out = host(&["bench", "--collectives"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("host launch -n 2 -- bench --collectives"));
}

#[test]
fn a_sharded_server_batches_requests_as_one_process_decodes_them() {
    let pair = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/dflash/gemma4-dense");
    let plugins = Path::new(env!("CARGO_BIN_EXE_host")).parent().unwrap().to_str().unwrap().to_owned();
    let (target, dflash) = (pair.join("target"), pair.join("drafter"));
    let source =
        ["--model", target.to_str().unwrap(), "--drafter", "dflash", "--drafter-artifact", dflash.to_str().unwrap()];
    let mut launcher = Command::new(env!("CARGO_BIN_EXE_host"))
        .args(["launch", "-n", "2", "--", "serve", "--port", "0", "--plugins-dir", &plugins])
        .args(source)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = std::io::BufReader::new(launcher.stderr.take().unwrap());
    let mut line = String::new();
    let address = loop {
        line.clear();
        assert!(std::io::BufRead::read_line(&mut stderr, &mut line).unwrap() > 0, "the server did not start");
        if let Some(address) = line.trim().strip_prefix("listening on ") {
            break address.to_owned();
        }
    };
    // Requests in flight together, of different lengths, greedy and seeded.
    let requests: Vec<(Vec<u32>, u32, f32)> = vec![
        (vec![2, 17, 90, 301, 44], 20, 0.0),
        (vec![5, 6, 7, 8, 5, 6, 7], 12, 0.0),
        (vec![9, 40, 9, 40, 9], 16, 0.8),
        (vec![300, 1, 2], 8, 0.0),
    ];
    let threads: Vec<_> = requests
        .iter()
        .cloned()
        .map(|(prompt, max_tokens, temperature)| {
            let url = format!("{address}/v1/completions");
            std::thread::spawn(move || {
                let body = serde_json::json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": temperature, "seed": 11});
                let reply: serde_json::Value = ureq::post(&url).send_json(body).unwrap().into_json().unwrap();
                let drafted = reply["usage"]["speculative"]["drafted_tokens"].as_u64().unwrap();
                (reply["choices"][0]["text"].as_str().unwrap().to_owned(), drafted)
            })
        })
        .collect();
    let (served, drafted): (Vec<String>, Vec<u64>) = threads.into_iter().map(|t| t.join().unwrap()).unzip();
    assert!(drafted.iter().sum::<u64>() > 0, "nothing was drafted");
    // SIGTERM reaches rank 0 through the launcher; rank 0 finishes and ends the other rank.
    assert!(processes::send(launcher.id(), Signal::Terminate));
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = launcher.try_wait().unwrap() {
            break status;
        }
        assert!(Instant::now() < deadline, "the sharded server did not stop within 30 s of SIGTERM");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "{status}");
    for ((prompt, max_tokens, temperature), text) in requests.iter().zip(&served) {
        let ids = prompt.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
        let (n, t) = (max_tokens.to_string(), temperature.to_string());
        let alone = host(
            &[
                &["run"][..],
                &["--model", target.to_str().unwrap(), "--prompt-ids", &ids],
                &["--max-tokens", &n, "--temperature", &t, "--seed", "11", "--json"],
            ]
            .concat(),
        );
        assert!(alone.status.success(), "{}", String::from_utf8_lossy(&alone.stderr));
        let json: serde_json::Value = serde_json::from_slice(&alone.stdout).unwrap();
        assert_eq!(json["text"].as_str().unwrap(), text, "prompt {ids}");
    }
}
