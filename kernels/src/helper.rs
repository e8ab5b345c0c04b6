//! One helper thread, kept awake while work comes, that computes part of a product (or of any
//! pass split in two, such as the host's sampling over a large vocabulary) while the calling
//! thread computes the rest.
//!
//! Written by hand because the thread pools at hand split work the wrong way for a decode step.
//! A step makes dozens of products of a few to a few hundred microseconds each, from one thread
//! that must stay on MLX's core (see [`crate::cpus`]). Starting a thread per product costs tens
//! of microseconds on a virtual machine, more than splitting most of them saves. rayon, called
//! from a thread outside its pool, runs both halves of a `join` on its workers and puts the
//! caller to sleep, which costs a wake-up per product as well. Here the caller computes its part
//! itself, and the helper, spinning between products, starts on the other at once; after 2 ms
//! without work it sleeps until the next.
//!
//! Each copy of this crate (the host's, and each plugin's) would have its own helper, and two
//! helpers on one core take turns at it: the drafter's spins through the first milliseconds of
//! the target's verify pass, and the target's through the drafter's. So the host hands its
//! helper to each plugin it loads (an extension of the plugin contract, which calls
//! [`use_shared`]), and a plugin's products then run on the host's helper; a plugin loaded by an
//! older host starts its own. A helper
//! lives as long as the process: a plugin library must never be unloaded while its helper
//! runs, and the host never unloads one.

use std::any::Any;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering};
use std::sync::{Arc, Mutex, OnceLock, TryLockError};
use std::thread::Thread;
use std::time::{Duration, Instant};

/// How long the helper waits for the next job before it sleeps. A decode step's products come
/// tens of microseconds apart, and steps follow each other within a few hundred.
const SPIN: Duration = Duration::from_millis(2);

/// A job handed to the helper: the closure, and what it panicked with.
struct Job<'a> {
    run: &'a mut (dyn FnMut() + Send),
    panic: Option<Box<dyn Any + Send>>,
}

struct Shared {
    /// The job to run, null when there is none. Points into the stack of the caller of [`join`],
    /// which does not return before `done` is set.
    job: AtomicPtr<Job<'static>>,
    done: AtomicBool,
    sleeping: AtomicBool,
}

struct Helper {
    shared: Arc<Shared>,
    thread: Thread,
    /// One caller at a time; a second one runs both parts itself.
    busy: Mutex<()>,
}

/// The helper, started on first use; `None` where it would have no core of its own (it would
/// only take turns with the caller) or no thread could be started.
fn helper() -> Option<&'static Helper> {
    static HELPER: OnceLock<Option<Helper>> = OnceLock::new();
    HELPER
        .get_or_init(|| {
            if !crate::cpus::helper_has_a_core() {
                return None;
            }
            let shared = Arc::new(Shared {
                job: AtomicPtr::new(std::ptr::null_mut()),
                done: AtomicBool::new(true),
                sleeping: AtomicBool::new(false),
            });
            let theirs = Arc::clone(&shared);
            let handle = std::thread::Builder::new()
                .name("product-helper".into())
                .spawn(move || {
                    crate::cpus::move_to_helper_cores();
                    serve(&theirs)
                })
                .ok()?;
            Some(Helper { shared, thread: handle.thread().clone(), busy: Mutex::new(()) })
        })
        .as_ref()
}

/// The helper's loop: run each job handed over, spin while more may come, then sleep.
fn serve(shared: &Shared) -> ! {
    let mut idle_since = Instant::now();
    loop {
        let job = shared.job.load(Ordering::Acquire);
        if !job.is_null() {
            // SAFETY: the caller of `join` keeps the job alive until `done` is set below.
            let job = unsafe { &mut *job };
            job.panic = catch_unwind(AssertUnwindSafe(&mut *job.run)).err();
            shared.job.store(std::ptr::null_mut(), Ordering::Relaxed);
            shared.done.store(true, Ordering::Release);
            idle_since = Instant::now();
        } else if idle_since.elapsed() < SPIN {
            // Yielding rather than only spinning lets another thread placed on this core (a
            // plugin's own helper, the server's I/O) run meanwhile.
            std::thread::yield_now();
        } else {
            shared.sleeping.store(true, Ordering::SeqCst);
            if shared.job.load(Ordering::SeqCst).is_null() {
                std::thread::park();
            }
            shared.sleeping.store(false, Ordering::SeqCst);
            idle_since = Instant::now();
        }
    }
}

/// Runs `mine` on the calling thread and `theirs` on the helper at the same time, and returns
/// when both are done; both run here, one after the other, when the helper is taken by another
/// thread or there is none: in a process with a single core, or if no thread could be started.
/// A panic in either is resumed here once both have finished. The helper is the one the
/// process shared with this copy ([`use_shared`]), else this copy's own.
pub fn join(mine: impl FnOnce() + Send, theirs: impl FnOnce() + Send) {
    let Some(shared) = SHARED.get() else { return join_here(mine, theirs) };
    let (mut mine, mut theirs) = (Some(mine), Some(theirs));
    let mut mine = || mine.take().into_iter().for_each(|f| f());
    let mut theirs = || theirs.take().into_iter().for_each(|f| f());
    shared(&mut mine, &mut theirs);
}

/// Elements from which [`rows_in_halves`] splits a pass: a prefill's rows (rows × a model's
/// width), not a decode step's or a verify window's few thousand, which take microseconds.
pub const SPLIT_ELEMENTS: usize = 1 << 16;

/// `each(first_row, rows_out)` over the rows of `out` (`width` elements each): in two halves of
/// whole rows, the second on the helper, where `out` holds [`SPLIT_ELEMENTS`] or more; else
/// all here at once. A row's result must not depend on the rows beside it, so that it is the
/// same either way.
pub fn rows_in_halves<T: Send>(out: &mut [T], width: usize, each: impl Fn(usize, &mut [T]) + Sync) {
    let rows = out.len() / width.max(1);
    if out.len() < SPLIT_ELEMENTS || rows < 2 {
        return each(0, out);
    }
    let half = rows / 2;
    let (first, second) = out.split_at_mut(half * width);
    join(|| each(0, first), || each(half, second));
}

/// [`join`] on this copy's own helper, whatever was shared: what a copy that shares its helper
/// runs for the others.
pub fn join_here(mine: impl FnOnce() + Send, theirs: impl FnOnce() + Send) {
    // A panic resumed below poisons the lock; the helper itself is still sound.
    let turn = |h: &'static Helper| match h.busy.try_lock() {
        Ok(turn) => Some((h, turn)),
        Err(TryLockError::Poisoned(poisoned)) => Some((h, poisoned.into_inner())),
        Err(TryLockError::WouldBlock) => None,
    };
    let Some((helper, _turn)) = helper().and_then(turn) else {
        mine();
        theirs();
        return;
    };
    let mut theirs = Some(theirs);
    let mut run = || {
        if let Some(f) = theirs.take() {
            f()
        }
    };
    let mut job = Job { run: &mut run, panic: None };
    let shared = &helper.shared;
    shared.done.store(false, Ordering::Relaxed);
    // SAFETY: the pointer is only read until `done` is set, and this function waits for that
    // (whatever `mine` does) before `job` goes out of scope.
    let erased = (&mut job as *mut Job<'_>).cast::<Job<'static>>();
    shared.job.store(erased, Ordering::SeqCst);
    if shared.sleeping.load(Ordering::SeqCst) {
        helper.thread.unpark();
    }
    let mine = catch_unwind(AssertUnwindSafe(mine));
    // Spin briefly, then yield, in case the helper waits for this very core.
    let mut spins = 0u32;
    while !shared.done.load(Ordering::Acquire) {
        if spins < 4096 {
            std::hint::spin_loop();
            spins += 1;
        } else {
            std::thread::yield_now();
        }
    }
    if let Some(panic) = job.panic.take() {
        resume_unwind(panic);
    }
    if let Err(panic) = mine {
        resume_unwind(panic);
    }
}

/// How another copy of this crate runs both parts of a [`join`] on its helper: the process
/// that loaded this copy (the host) hands it over, through the plugin contract, so that one
/// helper serves the whole process.
pub type SharedJoin = fn(mine: &mut (dyn FnMut() + Send), theirs: &mut (dyn FnMut() + Send));

/// The join of the copy that loaded this one, once it shared it.
static SHARED: OnceLock<SharedJoin> = OnceLock::new();

/// Runs every later [`join`] of this copy through `join` (a second call changes nothing).
pub fn use_shared(join: SharedJoin) {
    let _ = SHARED.set(join);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_parts_run_and_write_what_they_borrow() {
        for round in 0..1000u32 {
            let (mut a, mut b) = (0u32, 0u32);
            join(|| a = round, || b = round + 1);
            assert_eq!((a, b), (round, round + 1));
        }
    }

    /// Whether `theirs` runs on the helper thread within ten seconds of tries (other tests may
    /// hold it meanwhile).
    fn the_helper_takes_a_part() -> bool {
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            let mut name = None;
            join(|| {}, || name = std::thread::current().name().map(str::to_owned));
            if name.as_deref() == Some("product-helper") {
                return true;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        false
    }

    #[test]
    fn a_panic_in_either_part_reaches_the_caller_and_the_helper_goes_on() {
        assert!(catch_unwind(|| join(|| {}, || panic!("the helper's part"))).is_err());
        assert!(catch_unwind(|| join(|| panic!("the caller's part"), || {})).is_err());
        assert_eq!(the_helper_takes_a_part(), crate::cpus::helper_has_a_core());
    }

    #[test]
    fn callers_on_several_threads_each_get_both_parts_done() {
        std::thread::scope(|scope| {
            for t in 0..4u64 {
                scope.spawn(move || {
                    for round in 0..500u64 {
                        let (mut a, mut b) = (0u64, 0u64);
                        join(|| a = t * round, || b = t + round);
                        assert_eq!((a, b), (t * round, t + round));
                    }
                });
            }
        });
    }

    #[test]
    fn the_helper_wakes_after_sleeping() {
        std::thread::sleep(SPIN * 3);
        assert_eq!(the_helper_takes_a_part(), crate::cpus::helper_has_a_core());
    }
}
