//! SIMD kernels (see `lookup`).

use super::{Isa, KernelFn};
use tandem_quant::GgmlType;

/// The kernel for `ty` written for exactly `isa`, if any.
pub(super) fn lookup(ty: GgmlType, isa: Isa) -> Option<KernelFn> {
    let _ = (ty, isa);
    None
}
