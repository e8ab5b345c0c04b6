//! The extension table by which either side offers more than the root module and the target
//! view, looked up by a versioned id.

use std::ffi::c_void;

use abi_stable::abi_stability::abi_checking::check_layout_compatibility;
use abi_stable::type_layout::TypeLayout;
use abi_stable::StableAbi;

use crate::abi::DrafterRootRef;

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

/// The table `T` that the library of `root` offers under a versioned id: `Ok(None)` when it has
/// none (an older library), the layout checker's report when its layout is not `T`'s.
pub fn find<T: StableAbi>(root: DrafterRootRef, id: &str) -> Result<Option<&'static T>, String> {
    let Some(found) = (root.extension())(id.into()).into_option() else { return Ok(None) };
    check_layout_compatibility(T::LAYOUT, found.layout).map_err(|e| e.to_string())?;
    // SAFETY: the layout check proved the table has T's layout; tables are statics of a library
    // that is never unloaded.
    Ok(Some(unsafe { &*found.table.cast::<T>() }))
}
