//! MLX arrays at the boundary: a raw handle and the two ownership wrappers around it.

use std::ffi::c_void;
use std::marker::PhantomData;

use abi_stable::StableAbi;
use mlx_rs::Array;

/// An mlx-c array handle (`mlx_array { void *ctx }`), the same in every artifact because they
/// all share one `libmlx.so`. It says nothing about ownership; [`ArrayRef`] and [`OwnedArray`]
/// do. **ABI-frozen.**
#[repr(transparent)]
#[derive(StableAbi, Clone, Copy, Debug)]
pub struct RawArray {
    ctx: *mut c_void,
}

impl RawArray {
    fn from_mlx(handle: mlx_sys::mlx_array) -> Self {
        RawArray { ctx: handle.ctx }
    }

    fn to_mlx(self) -> mlx_sys::mlx_array {
        mlx_sys::mlx_array { ctx: self.ctx }
    }
}

/// An array lent for the duration of one call. The callee may read it, or take its own
/// reference with [`ArrayRef::to_array`]; it never frees it. **ABI-frozen.**
#[repr(transparent)]
#[derive(StableAbi, Clone, Copy, Debug)]
pub struct ArrayRef<'a> {
    raw: RawArray,
    lent: PhantomData<&'a ()>,
}

impl<'a> ArrayRef<'a> {
    pub fn new(array: &'a Array) -> Self {
        ArrayRef { raw: RawArray::from_mlx(array.as_ptr()), lent: PhantomData }
    }

    /// A new reference to the same array (MLX arrays are reference counted, so this copies no
    /// data). The result is the caller's to drop.
    pub fn to_array(&self) -> Array {
        // SAFETY: the handle is alive for 'a; mlx_array_set takes a new reference into `copy`.
        unsafe {
            let mut copy = mlx_sys::mlx_array_new();
            mlx_sys::mlx_array_set(&mut copy, self.raw.to_mlx());
            Array::from_ptr(copy)
        }
    }
}

/// An array handed over to the receiver, who frees it: by [`OwnedArray::into_array`] and then
/// dropping the `Array`, or by dropping this value. **ABI-frozen.**
///
/// ```
/// use mlx_rs::Array;
/// use plugin_api::OwnedArray;
///
/// let handed_over = OwnedArray::new(Array::from_slice(&[1.0f32, 2.0], &[2]));
/// let received = handed_over.into_array();
/// assert_eq!(received.as_slice::<f32>(), &[1.0, 2.0]);
/// ```
#[repr(transparent)]
#[derive(StableAbi, Debug)]
pub struct OwnedArray {
    raw: RawArray,
}

impl OwnedArray {
    pub fn new(array: Array) -> Self {
        let raw = RawArray::from_mlx(array.as_ptr());
        std::mem::forget(array);
        OwnedArray { raw }
    }

    /// Lends the array for a call without giving up ownership.
    pub fn borrow(&self) -> ArrayRef<'_> {
        ArrayRef { raw: self.raw, lent: PhantomData }
    }

    pub fn into_array(self) -> Array {
        let handle = self.raw.to_mlx();
        std::mem::forget(self);
        // SAFETY: this value held the only claim on the handle, made by `OwnedArray::new`.
        unsafe { Array::from_ptr(handle) }
    }
}

impl Drop for OwnedArray {
    fn drop(&mut self) {
        // SAFETY: as in `into_array`; the shared libmlx frees it whichever side drops.
        drop(unsafe { Array::from_ptr(self.raw.to_mlx()) });
    }
}

// SAFETY: an owned MLX array may move between threads, as `mlx_rs::Array` may.
unsafe impl Send for OwnedArray {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owned_round_trip_keeps_the_data() {
        let a = Array::from_slice(&[1.0f32, 2.0, 3.0], &[3]);
        let back = OwnedArray::new(a).into_array();
        assert_eq!(back.as_slice::<f32>(), &[1.0, 2.0, 3.0]);
    }

    #[test]
    fn borrowed_reference_outlives_the_loan() {
        let a = Array::from_slice(&[4i32, 5], &[2]);
        let copy = ArrayRef::new(&a).to_array();
        drop(a);
        assert_eq!(copy.as_slice::<i32>(), &[4, 5]);
    }
}
