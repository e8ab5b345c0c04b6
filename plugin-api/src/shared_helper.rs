//! The extension `shared-helper/1`: the host hands its kernels' helper thread to each plugin it
//! loads, so that one helper serves the whole process ([`helper`] says why).

use std::any::Any;
use std::ffi::c_void;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::OnceLock;

use crate::nn::helper;

/// The id of the extension by which the host shares its helper with a plugin.
pub const SHARED_HELPER_ID: &str = "shared-helper/1";

/// One part of a [`helper::join`] handed across the plugin boundary: `run(data)` runs it and never
/// unwinds. **ABI-frozen.**
#[repr(C)]
#[derive(abi_stable::StableAbi)]
pub struct Part {
    pub data: *mut c_void,
    pub run: unsafe extern "C" fn(data: *mut c_void),
}

/// A helper shared across the boundary: `join(mine, theirs)` runs `mine` on the calling thread
/// and `theirs` on the sharer's helper thread, and returns when both are done. **ABI-frozen.**
#[repr(C)]
#[derive(abi_stable::StableAbi, Clone, Copy)]
pub struct SharedHelper {
    pub join: unsafe extern "C" fn(mine: Part, theirs: Part),
}

/// The extension [`SHARED_HELPER_ID`]: `share` makes the plugin's products run on the host's
/// helper from then on (a second call changes nothing). **ABI-frozen.**
#[repr(C)]
#[derive(abi_stable::StableAbi)]
pub struct SharedHelperExtension {
    pub share: extern "C" fn(helper: SharedHelper),
}

/// The table every plugin built with this crate exports under [`SHARED_HELPER_ID`].
pub static SHARED_HELPER_EXTENSION: SharedHelperExtension = SharedHelperExtension { share: accept_shared };

/// The helper of the process that loaded this copy of the crate, once it shared it.
static HOSTS_HELPER: OnceLock<SharedHelper> = OnceLock::new();

extern "C" fn accept_shared(hosts: SharedHelper) {
    if HOSTS_HELPER.set(hosts).is_ok() {
        helper::use_shared(join_on_hosts);
    }
}

/// The kernels' joins, once the host shared its helper.
fn join_on_hosts(mine: &mut (dyn FnMut() + Send), theirs: &mut (dyn FnMut() + Send)) {
    match HOSTS_HELPER.get() {
        Some(host) => join_on(host, mine, theirs),
        None => {
            mine();
            theirs();
        }
    }
}

/// This copy's helper, for the plugins this process loads.
pub fn shared() -> SharedHelper {
    SharedHelper { join: join_parts }
}

unsafe extern "C" fn join_parts(mine: Part, theirs: Part) {
    struct Sendable(Part);
    // SAFETY: a Part is built by `join_on` from closures that are Send.
    unsafe impl Send for Sendable {}
    impl Sendable {
        fn run(self) {
            // SAFETY: the part's `run` is given the data it was built with, once.
            unsafe { (self.0.run)(self.0.data) }
        }
    }
    let (mine, theirs) = (Sendable(mine), Sendable(theirs));
    helper::join_here(move || mine.run(), move || theirs.run());
}

/// A closure and what it panicked with, behind a [`Part`].
struct Closure<F> {
    f: Option<F>,
    panic: Option<Box<dyn Any + Send>>,
}

impl<F: FnOnce()> Closure<F> {
    fn part(&mut self) -> Part {
        Part { data: (self as *mut Self).cast(), run: Self::run }
    }

    /// Runs the closure, keeping its panic: an unwind must not cross the other copy's frames.
    unsafe extern "C" fn run(data: *mut c_void) {
        // SAFETY: `data` is the Closure that `part` was called on, alive until `join_on` returns.
        let closure = unsafe { &mut *data.cast::<Self>() };
        if let Some(f) = closure.f.take() {
            closure.panic = catch_unwind(AssertUnwindSafe(f)).err();
        }
    }
}

/// [`helper::join`] on a helper shared by the host.
fn join_on(host: &SharedHelper, mine: impl FnOnce() + Send, theirs: impl FnOnce() + Send) {
    let mut mine = Closure { f: Some(mine), panic: None };
    let mut theirs = Closure { f: Some(theirs), panic: None };
    // SAFETY: both parts point at closures on this stack, which outlive the call.
    unsafe { (host.join)(mine.part(), theirs.part()) };
    if let Some(panic) = theirs.panic.or(mine.panic) {
        resume_unwind(panic);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_handed_across_the_boundary_run_and_their_panics_come_back() {
        let helper = shared();
        for round in 0..200u32 {
            let (mut a, mut b) = (0u32, 0u32);
            join_on(&helper, || a = round, || b = round + 1);
            assert_eq!((a, b), (round, round + 1));
        }
        let theirs = catch_unwind(|| join_on(&helper, || {}, || panic!("the helper's part")));
        assert_eq!(theirs.unwrap_err().downcast_ref::<&str>(), Some(&"the helper's part"));
        let mine = catch_unwind(|| join_on(&helper, || panic!("the caller's part"), || {}));
        assert_eq!(mine.unwrap_err().downcast_ref::<&str>(), Some(&"the caller's part"));
    }
}
