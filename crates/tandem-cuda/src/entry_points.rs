// The kernel entry points of every kernels/*.cu file (kernels/ABI.md), as (file stem, name).
// Read by the runtime to find the kernels in the loaded images, and by build.rs (include!) to
// register the host-emulated ones: keep it a plain list.

/// Weight types with a `tandem_matvec_<t>` and `tandem_dequant_<t>_f16` / `_f32` kernels, by ggml name.
pub const MATVEC_TYPE_NAMES: [&str; 10] =
    ["f32", "f16", "bf16", "q4_0", "q5_0", "q8_0", "q4_K", "q5_K", "q6_K", "iq4_xs"];

/// KV cache formats with `tandem_kv_store_<c>`, `tandem_attn_<c>` and `tandem_attn_mla_<c>`.
pub const CACHE_TYPE_NAMES: [&str; 3] = ["f16", "bf16", "q8_0"];

/// The entry points that are not one per weight or cache type.
pub const FIXED_ENTRY_POINTS: [(&str, &str); 18] = [
    ("rmsnorm", "tandem_rmsnorm_f32"),
    ("rope", "tandem_rope_f32"),
    ("swiglu", "tandem_swiglu_f32"),
    ("add", "tandem_add_f32"),
    ("add", "tandem_scale_add_f32"),
    ("add", "tandem_scale_f32"),
    ("add", "tandem_scale_rows_f32"),
    ("copy", "tandem_copy_rows_f32"),
    ("router", "tandem_router_f32"),
    ("moe", "tandem_moe_pack_f32"),
    ("moe", "tandem_moe_sum_f32"),
    ("dequant", "tandem_f32_to_f16"),
    ("dequant", "tandem_f32_to_f16_scaled"),
    ("attention", "tandem_attn_combine"),
    ("round", "tandem_round_q8_0"),
    ("round", "tandem_round_q8_K"),
    ("round", "tandem_round_f16"),
    ("round", "tandem_round_bf16"),
];

/// Every entry point as (file stem, name).
pub fn all_entry_points() -> Vec<(&'static str, String)> {
    let mut v: Vec<(&'static str, String)> = FIXED_ENTRY_POINTS.iter().map(|&(f, n)| (f, n.to_string())).collect();
    for t in MATVEC_TYPE_NAMES {
        v.push(("matvec", format!("tandem_matvec_{t}")));
        v.push(("dequant", format!("tandem_dequant_{t}_f16")));
        v.push(("dequant", format!("tandem_dequant_{t}_f32")));
    }
    for c in CACHE_TYPE_NAMES {
        v.push(("kv", format!("tandem_kv_store_{c}")));
        v.push(("attention", format!("tandem_attn_{c}")));
        v.push(("attention", format!("tandem_attn_mla_{c}")));
    }
    v
}
