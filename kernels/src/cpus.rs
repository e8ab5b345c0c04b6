//! Which cores run MLX's CPU work and which run the kernels' helper threads.
//!
//! MLX runs every CPU op on a worker thread of its own: the thread that builds the graph wakes
//! it for each op, and is woken back when an evaluation completes. When the two threads sit on
//! different cores every wake is an inter-processor interrupt, which on virtual machines costs
//! tens of microseconds: with a wake per op, a small model's decoding then spends a large share
//! of its time on wakes, and runs faster confined to one core than spread over two. Products of
//! large weights still want a second core, where a helper thread computes half of each product.
//! So the process's driving thread and MLX's worker share one core, and the kernels' helper
//! thread ([`crate::helper`]) runs on the others.
//!
//! The host pins itself once at start-up and names the helper cores in [`HELPER_CPUS_ENV`], which
//! every copy of this crate in the process (the host's and each plugin's) reads. Threads are
//! pinned on Linux only; elsewhere [`pin`] refuses, and the scheduler places them.

use std::sync::OnceLock;

/// The cores helper threads move to, as a comma-separated list of CPU numbers.
pub const HELPER_CPUS_ENV: &str = "HOST_HELPER_CPUS";

/// The cores the calling thread may run on.
#[cfg(target_os = "linux")]
pub fn allowed() -> Vec<usize> {
    // SAFETY: sched_getaffinity fills a zeroed cpu_set_t of the size given.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return Vec::new();
        }
        (0..libc::CPU_SETSIZE as usize).filter(|&c| libc::CPU_ISSET(c, &set)).collect()
    }
}

/// The cores the calling thread may run on: where affinity cannot be read (macOS, Windows),
/// every core the system reports.
#[cfg(not(target_os = "linux"))]
pub fn allowed() -> Vec<usize> {
    (0..std::thread::available_parallelism().map_or(1, usize::from)).collect()
}

/// Confines the calling thread to `cpus`; false if the system refused.
#[cfg(target_os = "linux")]
pub fn pin(cpus: &[usize]) -> bool {
    // SAFETY: sched_setaffinity reads a cpu_set_t built here; 0 means the calling thread.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for &c in cpus {
            libc::CPU_SET(c, &mut set);
        }
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0
    }
}

/// Confines the calling thread to `cpus`: always refused where threads cannot be pinned
/// (macOS offers only affinity hints, Windows another API), which leaves the scheduler to
/// place MLX's worker and the helper.
#[cfg(not(target_os = "linux"))]
pub fn pin(_cpus: &[usize]) -> bool {
    false
}

/// Confines the calling thread to the first of its cores and returns the others, for
/// [`HELPER_CPUS_ENV`]; `None` (nothing changed) with fewer than two cores. Call it before MLX
/// starts its worker thread, which inherits the affinity.
pub fn share_one_core_with_mlx() -> Option<String> {
    let cpus = allowed();
    let (&first, rest) = cpus.split_first()?;
    if rest.is_empty() || !pin(&[first]) {
        return None;
    }
    Some(rest.iter().map(usize::to_string).collect::<Vec<_>>().join(","))
}

/// The helper cores the process named in [`HELPER_CPUS_ENV`] (none if it named none).
fn named_helpers() -> &'static [usize] {
    static HELPERS: OnceLock<Vec<usize>> = OnceLock::new();
    HELPERS.get_or_init(|| {
        std::env::var(HELPER_CPUS_ENV)
            .map(|list| list.split(',').filter_map(|c| c.trim().parse().ok()).collect())
            .unwrap_or_default()
    })
}

/// Confines the calling thread (the kernels' helper) to the helper cores the process named, if
/// it named any.
pub(crate) fn move_to_helper_cores() {
    let helpers = named_helpers();
    if !helpers.is_empty() {
        pin(helpers);
    }
}

/// Whether a helper thread has a core of its own: the helper cores when the process named
/// them, else a second core among the calling thread's.
pub(crate) fn helper_has_a_core() -> bool {
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| !named_helpers().is_empty() || allowed().len() >= 2)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_driving_thread_keeps_its_first_core_and_names_the_others() {
        // On a thread of its own: the test harness's threads keep their affinity.
        std::thread::spawn(|| {
            let before = allowed();
            match share_one_core_with_mlx() {
                None => assert!(before.len() == 1 || !pin(&before), "{before:?} could be pinned"),
                Some(helpers) => {
                    assert_eq!(allowed(), vec![before[0]]);
                    let named: Vec<usize> = helpers.split(',').map(|c| c.parse().unwrap()).collect();
                    assert_eq!(named, before[1..]);
                }
            }
        })
        .join()
        .unwrap();
    }
}
