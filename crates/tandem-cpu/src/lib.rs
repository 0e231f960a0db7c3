//! CPU backend. Filled in by the inference and performance issues: SIMD kernels chosen at run time,
//! quantized matvec/matmul and the routed-expert FFN.
