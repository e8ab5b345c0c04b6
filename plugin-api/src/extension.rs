//! The extension table by which either side offers more than the root module and the target
//! view, looked up by a versioned id.

use std::ffi::c_void;

use abi_stable::type_layout::TypeLayout;
use abi_stable::StableAbi;

/// An extension table: a pointer to a `StableAbi` struct and that struct's layout, which the
/// host checks against the layout it expects for the id before using the table.
/// **ABI-frozen.**
#[repr(C)]
#[derive(StableAbi, Clone, Copy)]
pub struct Extension {
    pub layout: &'static TypeLayout,
    pub table: *const c_void,
}

impl Extension {
    /// The extension table `table`, which must live as long as the library (a `static`).
    pub fn of<T: StableAbi>(table: &'static T) -> Self {
        Extension { layout: T::LAYOUT, table: (table as *const T).cast() }
    }
}
