//! The x86-64 SIMD kernels of [`super`], one directory per family as in `super` (`kquants/`,
//! `legacy/`), each with the tables its family file dispatches from, and the macro they share.

/// The body of a [`super::TileFn`]: calls `$tile::<$g.., NR, NY>(n, w, bytes per weight row, ys, out)`
/// with the weight rows `NR` (2 or 4, from `out.len() / ny`) and the tokens `NY` (1..=8) as
/// constants, so the accumulators live in registers; other counts (which `Kernel::run_tile` never
/// passes) give NaN.
macro_rules! tile_body {
    ($tile:ident::<$($g:ty),*>, $n:expr, $w:expr, $ys:expr, $ny:expr, $out:expr) => {{
        let (n, w, ys, ny, out): (usize, &[u8], &[u8], usize, &mut [f32]) = ($n, $w, $ys, $ny, $out);
        let nr = out.len() / ny.max(1);
        let ws = w.len() / nr.max(1);
        let (w, ys, o) = (w.as_ptr(), ys.as_ptr(), out.as_mut_ptr());
        // SAFETY: `Kernel::run_tile` checked w, ys and out against n, nr (in TILE_ROWS) and ny.
        unsafe {
            match (nr, ny) {
                (2, 1) => $tile::<$($g,)* 2, 1>(n, w, ws, ys, o),
                (2, 2) => $tile::<$($g,)* 2, 2>(n, w, ws, ys, o),
                (2, 3) => $tile::<$($g,)* 2, 3>(n, w, ws, ys, o),
                (2, 4) => $tile::<$($g,)* 2, 4>(n, w, ws, ys, o),
                (2, 5) => $tile::<$($g,)* 2, 5>(n, w, ws, ys, o),
                (2, 6) => $tile::<$($g,)* 2, 6>(n, w, ws, ys, o),
                (2, 7) => $tile::<$($g,)* 2, 7>(n, w, ws, ys, o),
                (2, 8) => $tile::<$($g,)* 2, 8>(n, w, ws, ys, o),
                (4, 1) => $tile::<$($g,)* 4, 1>(n, w, ws, ys, o),
                (4, 2) => $tile::<$($g,)* 4, 2>(n, w, ws, ys, o),
                (4, 3) => $tile::<$($g,)* 4, 3>(n, w, ws, ys, o),
                (4, 4) => $tile::<$($g,)* 4, 4>(n, w, ws, ys, o),
                (4, 5) => $tile::<$($g,)* 4, 5>(n, w, ws, ys, o),
                (4, 6) => $tile::<$($g,)* 4, 6>(n, w, ws, ys, o),
                (4, 7) => $tile::<$($g,)* 4, 7>(n, w, ws, ys, o),
                (4, 8) => $tile::<$($g,)* 4, 8>(n, w, ws, ys, o),
                _ => out.fill(f32::NAN),
            }
        }
    }};
}

pub(super) mod kquants;
pub(super) mod legacy;
