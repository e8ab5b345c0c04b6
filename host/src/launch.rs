//! `host launch`: starts the ranks of a tensor-parallel run with the ring backend's own
//! environment (`MLX_RANK`, `MLX_HOSTFILE`), as `mlx.launch` does, and watches them: the first
//! rank to fail ends the others, so a dead rank never leaves its peers waiting in a collective.
//!
//! Ranks on this machine are started directly, each pinned to its own share of the cores so
//! that their BLAS and kernel threads do not fight; ranks on other hosts are started over
//! `ssh`, which needs this executable and the hostfile at the same paths there.

use std::ffi::OsString;
use std::net::{IpAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kernels::os::{processes, signals};

use crate::distributed::{read_hostfile, DistributedError, HOSTFILE_ENV, RANK_ENV};

#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    #[error(transparent)]
    Hostfile(#[from] DistributedError),
    #[error("-n {given} does not match the {listed} ranks of {file}")]
    Count { given: usize, listed: usize, file: PathBuf },
    #[error("-n: at least one rank")]
    NoRanks,
    #[error("{what}: {error}")]
    Io { what: String, error: std::io::Error },
    #[error("rank {rank} ({how}); the other ranks were stopped")]
    RankFailed { rank: usize, how: String },
}

pub struct LaunchOptions {
    /// Ranks on loopback (without a hostfile), or the hostfile's count, checked.
    pub ranks: Option<usize>,
    pub hostfile: Option<PathBuf>,
    /// The host command each rank runs (`run …`, without the executable).
    pub args: Vec<OsString>,
}

/// Starts every rank and waits for all of them; only rank 0's standard output is kept. Returns
/// the exit status to end with when a SIGINT or SIGTERM stopped the ranks (rank 0's own, 130 or
/// 143, once it printed what it produced).
pub fn launch(options: &LaunchOptions) -> Result<Option<i32>, LaunchError> {
    let io = |what: &str| {
        let what = what.to_owned();
        move |error| LaunchError::Io { what, error }
    };
    let (hostfile, addresses, temporary) = match &options.hostfile {
        Some(file) => {
            let addresses = read_hostfile(file)?;
            if let Some(given) = options.ranks.filter(|&n| n != addresses.len()) {
                return Err(LaunchError::Count { given, listed: addresses.len(), file: file.clone() });
            }
            (std::path::absolute(file).map_err(io("the hostfile's path"))?, addresses, false)
        }
        None => {
            let n = options.ranks.unwrap_or(2);
            if n == 0 {
                return Err(LaunchError::NoRanks);
            }
            let addresses = loopback_addresses(n).map_err(io("finding free loopback ports"))?;
            let file = std::env::temp_dir().join(format!("host-launch-{}.json", std::process::id()));
            let json = serde_json::to_string(&addresses).expect("strings serialize");
            std::fs::write(&file, json).map_err(io(&format!("writing {}", file.display())))?;
            (file, addresses, true)
        }
    };
    let result = start_and_watch(&hostfile, &addresses, &options.args);
    if temporary {
        let _ = std::fs::remove_file(&hostfile);
    }
    result
}

fn start_and_watch(hostfile: &Path, addresses: &[Vec<String>], args: &[OsString]) -> Result<Option<i32>, LaunchError> {
    let exe = std::env::current_exe().map_err(|error| LaunchError::Io { what: "this executable".into(), error })?;
    let local: Vec<bool> = addresses.iter().map(|a| a.iter().all(|addr| is_loopback(addr))).collect();
    let cores = crate::runtime::process_cpus();
    let local_ranks = local.iter().filter(|&&l| l).count();
    let mut children: Vec<Child> = Vec::new();
    let stopping = Arc::new(AtomicBool::new(false));
    for (rank, addrs) in addresses.iter().enumerate() {
        let (mut command, share) = if local[rank] {
            // Each local rank on its own share of the cores, when there are enough.
            let slot = local[..rank].iter().filter(|&&l| l).count();
            let n = cores.len();
            let share = if n >= local_ranks {
                cores[slot * n / local_ranks..(slot + 1) * n / local_ranks].to_vec()
            } else {
                cores.clone()
            };
            let mut c = Command::new(&exe);
            c.args(args).env(RANK_ENV, rank.to_string()).env(HOSTFILE_ENV, hostfile);
            (c, share)
        } else {
            let host = addrs[0].rsplit_once(':').map_or(addrs[0].as_str(), |(h, _)| h);
            // ssh hands the remote shell one line: every word is quoted for it.
            let mut words = vec![
                "env".to_owned(),
                format!("{RANK_ENV}={rank}"),
                format!("{HOSTFILE_ENV}={}", hostfile.display()),
                exe.display().to_string(),
            ];
            words.extend(args.iter().map(|a| a.to_string_lossy().into_owned()));
            let line: Vec<String> = words.iter().map(|w| shell_quoted(w)).collect();
            let mut c = Command::new("ssh");
            c.args(["-o", "BatchMode=yes", host, &line.join(" ")]);
            (c, cores.clone())
        };
        if rank > 0 {
            command.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::piped());
        }
        // A terminal's Ctrl-C reaches the launcher alone, which tells rank 0 once; ranks that
        // each took it would stop at different tokens and leave the others in a collective.
        processes::in_own_group(&mut command);
        match crate::runtime::starting_children_on(&share, || command.spawn()) {
            Ok(mut child) => {
                if let Some(stderr) = child.stderr.take() {
                    pass_stderr_on(stderr, stopping.clone());
                }
                children.push(child)
            }
            Err(error) => {
                stop(&mut children);
                return Err(LaunchError::Io { what: format!("starting rank {rank}"), error });
            }
        }
    }
    watch(children, &stopping)
}

/// Copies a rank's stderr to the launcher's, line by line, until the ranks are being stopped on
/// request: what a rank says then (the ring's "connection lost" as rank 0 leaves) is the stop
/// itself, not news.
fn pass_stderr_on(stderr: std::process::ChildStderr, stopping: Arc<AtomicBool>) {
    std::thread::spawn(move || {
        use std::io::{BufRead, Write};
        for line in std::io::BufReader::new(stderr).lines().map_while(Result::ok) {
            if !stopping.load(Ordering::SeqCst) {
                let _ = writeln!(std::io::stderr(), "{line}");
            }
        }
    });
}

/// How long the other ranks may run on after rank 0 finished: they end within a round of it,
/// unless rank 0 stopped early (its output closed, an interrupt) and left them in a collective.
const AFTER_RANK_0: Duration = Duration::from_secs(10);

/// Waits for every rank; when one fails, stops the rest and says which one and how. Of ranks
/// found failed together, one killed by a signal is named first: the others are likely to have
/// failed because it went away. A SIGINT or SIGTERM is passed on to rank 0 once, as it came; when rank 0 has
/// then finished, the other ranks are stopped and rank 0's status is returned.
fn watch(mut children: Vec<Child>, stopping: &AtomicBool) -> Result<Option<i32>, LaunchError> {
    // Stopping is rank 0's to decide (it prints what it produced; a server finishes what it
    // holds and tells the other ranks to end).
    signals::watch_stop_requests();
    let mut done = vec![false; children.len()];
    let mut rank_0_done: Option<Instant> = None;
    let mut stop_requested = false;
    while done.iter().any(|d| !d) {
        if let Some(rank) =
            rank_0_done.filter(|t| t.elapsed() > AFTER_RANK_0).and_then(|_| done.iter().position(|d| !d))
        {
            stop(&mut children);
            let how = format!("still running {} s after rank 0 finished", AFTER_RANK_0.as_secs());
            return Err(LaunchError::RankFailed { rank, how });
        }
        if let Some(signal) = signals::take_stop_request().filter(|_| !stop_requested && !done[0]) {
            stop_requested = true;
            stopping.store(true, Ordering::SeqCst);
            signals::pass_on(&children[0], signal);
        }
        let mut failed: Vec<(usize, ExitStatus)> = Vec::new();
        for (rank, child) in children.iter_mut().enumerate() {
            if done[rank] {
                continue;
            }
            let status = child
                .try_wait()
                .map_err(|error| LaunchError::Io { what: format!("waiting for rank {rank}"), error })?;
            if let Some(status) = status {
                done[rank] = true;
                if rank == 0 {
                    rank_0_done = Some(Instant::now());
                    if stop_requested {
                        // Rank 0 stopped as asked: the others wait on it in a collective.
                        stop(&mut children);
                        return Ok(Some(status.code().unwrap_or(1)));
                    }
                }
                if !status.success() {
                    failed.push((rank, status));
                }
            }
        }
        if let Some(&(rank, status)) =
            failed.iter().find(|(_, s)| signals::ending_signal(s).is_some()).or(failed.first())
        {
            stop(&mut children);
            return Err(LaunchError::RankFailed { rank, how: describe(status) });
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(None)
}

/// Asks every rank still running to stop (SIGTERM), then kills what is left after a grace period.
fn stop(children: &mut [Child]) {
    for child in children.iter() {
        signals::ask_to_stop(child);
    }
    let deadline = Instant::now() + Duration::from_secs(3);
    for child in children.iter_mut() {
        while child.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        let _ = child.wait();
    }
}

fn describe(status: ExitStatus) -> String {
    match (status.code(), signals::ending_signal(&status)) {
        (Some(code), _) => format!("exited with status {code}"),
        (None, Some(signal)) => format!("killed by signal {signal}"),
        _ => status.to_string(),
    }
}

/// `word` as one word of a POSIX shell command line.
fn shell_quoted(word: &str) -> String {
    format!("'{}'", word.replace('\'', "'\\''"))
}

/// One free port on 127.0.0.1 per rank, in the ring hostfile's shape.
fn loopback_addresses(n: usize) -> std::io::Result<Vec<Vec<String>>> {
    // All listeners are held until every port is known, so that no two ranks get the same one.
    let listeners: Vec<TcpListener> = (0..n).map(|_| TcpListener::bind("127.0.0.1:0")).collect::<Result<_, _>>()?;
    listeners.iter().map(|l| Ok(vec![l.local_addr()?.to_string()])).collect()
}

fn is_loopback(address: &str) -> bool {
    let host = address.rsplit_once(':').map_or(address, |(h, _)| h);
    host == "localhost" || host.trim_matches(['[', ']']).parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_ranks_get_distinct_ports_and_are_started_here() {
        let addresses = loopback_addresses(3).unwrap();
        let mut ports: Vec<&String> = addresses.iter().map(|a| &a[0]).collect();
        ports.sort();
        ports.dedup();
        assert_eq!(ports.len(), 3);
        assert!(addresses.iter().all(|a| is_loopback(&a[0])));
        assert!(is_loopback("localhost:5000") && is_loopback("[::1]:5000"));
        assert!(!is_loopback("10.0.0.2:5000"));
    }

    #[test]
    fn words_sent_over_ssh_survive_the_remote_shell() {
        assert_eq!(shell_quoted("In the beginning"), "'In the beginning'");
        assert_eq!(shell_quoted("it's"), "'it'\\''s'");
    }
}
