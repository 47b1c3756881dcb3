//! Strings across the boundary: C string arguments in ([`c_str`]), and the
//! text-buffer protocol out ([`write_text`]) that every `gpupool_*_json`
//! function follows.
//!
//! Invariant: a buffer that is too small receives nothing but `buf[0] = 0`
//! (when `len > 0`); the bytes needed (NUL included) are always recorded for
//! `gpupool_needed_len`.

use super::status::{set_needed, FResult, Fail, GpupoolStatus};
use std::ffi::{c_char, CStr};

/// Writes `s` NUL-terminated into `buf`, or reports the size needed.
///
/// # Safety
/// `buf` is NULL or valid for writes of `len` bytes.
pub(super) unsafe fn write_text(buf: *mut c_char, len: usize, s: &str) -> FResult<()> {
    let need = s.len() + 1;
    set_needed(need);
    if buf.is_null() {
        if len == 0 {
            return Err(Fail::new(
                GpupoolStatus::BufferTooSmall,
                format!("size query: {need} bytes needed (including the NUL)"),
            ));
        }
        return Err(Fail::null("buf"));
    }
    if len < need {
        if len > 0 {
            // SAFETY: `buf` is valid for `len >= 1` bytes (caller's contract).
            unsafe { *buf = 0 };
        }
        return Err(Fail::new(
            GpupoolStatus::BufferTooSmall,
            format!("buffer of {len} bytes too small: {need} bytes needed (including the NUL)"),
        ));
    }
    // SAFETY: `buf` is valid for `len >= need = s.len() + 1` bytes, and a
    // Rust string cannot overlap memory the caller handed us for writing.
    unsafe {
        std::ptr::copy_nonoverlapping(s.as_ptr(), buf.cast::<u8>(), s.len());
        *buf.add(s.len()) = 0;
    }
    Ok(())
}

/// Reads a C string argument.
///
/// # Safety
/// `p` is NULL or points to a NUL-terminated string.
pub(super) unsafe fn c_str<'a>(p: *const c_char, arg: &str) -> FResult<&'a str> {
    if p.is_null() {
        return Err(Fail::null(arg));
    }
    // SAFETY: non-NULL and NUL-terminated by the caller's contract.
    let c = unsafe { CStr::from_ptr(p) };
    c.to_str().map_err(|e| {
        Fail::new(
            GpupoolStatus::InvalidArgument,
            format!("argument `{arg}` is not UTF-8: {e}"),
        )
    })
}
