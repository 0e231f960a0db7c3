//! The Kimi-K2.5-shaped replica: written sparse into a temporary directory, opened like the real
//! 13-shard download, and planned with the command line of the issue.

use std::os::unix::fs::MetadataExt;
use tandem_gguf::{GgmlType, GgufModel, LoadOptions, TensorCategory};
use tandem_plan::quant_mix::Ftype;
use tandem_plan::replica::{kimi, write_kimi_k25};
use tandem_plan::{plan, Device, GpuBudget, GpuLayers, KvConfig, ModelInfo, PlanRequest, Rule, GIB};

fn open_replica(ftype: Ftype) -> (tempfile::TempDir, ModelInfo) {
    let dir = tempfile::tempdir().unwrap();
    let first = write_kimi_k25(dir.path(), ftype).unwrap();
    let gguf = GgufModel::open(&first, LoadOptions::default()).unwrap();
    assert_eq!(gguf.shards().len(), kimi::N_SHARDS as usize);
    let model = ModelInfo::from_gguf(&gguf, &first.display().to_string()).unwrap();
    (dir, model)
}

/// `-ngl 999 -ot exps=CPU -c 131072 -ctk f16 --gpu CUDA0=96GiB`.
fn issue_request() -> PlanRequest {
    PlanRequest {
        gpus: GpuBudget::parse_all(&["CUDA0=96GiB"]).unwrap(),
        rules: Rule::parse_overrides(&["exps=CPU"]).unwrap(),
        n_gpu_layers: Some(GpuLayers::Count(999)),
        kv: KvConfig { ctx: 131072, ..KvConfig::default() },
        ..PlanRequest::default()
    }
}

#[test]
fn replica_has_kimi_shapes_and_costs_no_disk() {
    let (dir, model) = open_replica(Ftype::Q4_K_M);
    let h = &model.hparams;
    assert_eq!((h.n_layer, h.n_embd, h.n_head, h.n_vocab), (61, 7168, 64, 163840));
    assert_eq!((h.n_expert, h.n_expert_used, h.n_ff_exp, h.n_ff), (384, 8, 2048, 18432));
    assert_eq!(h.k_per_token[0], 576, "kv_lora 512 + rope 64");
    // 1 + 61 x 10 (attention, norms) + 3 (dense layer 0) + 60 x 8 (MoE layers) + 2 (output).
    assert_eq!(model.tensors.len(), 1096);
    let t = |name: &str| model.tensors.iter().find(|t| t.name == name).unwrap();
    assert_eq!(t("blk.5.ffn_down_exps.weight").dims, [2048, 7168, 384]);
    assert_eq!(t("blk.5.ffn_down_exps.weight").ty, GgmlType::Q6_K);
    assert_eq!(t("blk.8.ffn_down_exps.weight").ty, GgmlType::Q4_K);
    assert_eq!(t("blk.5.attn_k_b.weight").ty, GgmlType::Q5_0);
    assert_eq!(t("output.weight").ty, GgmlType::Q6_K);
    let claimed: u64 = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().metadata().unwrap().len()).sum();
    let on_disk: u64 =
        std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().metadata().unwrap().blocks() * 512).sum();
    assert!(claimed > 500 * GIB, "{claimed}");
    assert!(on_disk < 64 << 20, "the replica should be sparse, {on_disk} bytes on disk");
}

#[test]
fn issue_command_line_puts_only_routed_experts_on_the_cpu() {
    for ftype in [Ftype::Q4_K_S, Ftype::Q4_K_M] {
        let (_dir, model) = open_replica(ftype);
        let p = plan(&model, &issue_request()).unwrap();
        println!("--- {} ---\n{}", ftype.name(), p.to_text(false));
        for t in &p.tensors {
            let want = if t.category == TensorCategory::RoutedExperts { Device::Cpu } else { Device::Cuda(0) };
            assert_eq!(t.device, want, "{}", t.name);
        }
        let weights: u64 = p.devices.iter().map(|d| d.weights_bytes).sum();
        assert_eq!(weights, model.total_bytes(), "totals equal the sum of the headers' tensor sizes");
        let cpu = p.device(Device::Cpu).unwrap();
        assert_eq!(cpu.weights_bytes, cpu.by_category.routed_experts);
        // MLA: 61 layers x 576 elements x 2 bytes x 131072 cells.
        assert_eq!(p.kv.bytes, 61 * 576 * 2 * 131072);
        assert_eq!(p.device(Device::Cuda(0)).unwrap().kv_bytes, p.kv.bytes);
        assert!(p.fits);
    }
}

#[test]
fn fit_fills_a_gpu_with_the_last_layers_experts() {
    let (_dir, model) = open_replica(Ftype::Q4_K_M);
    let req = PlanRequest {
        gpus: GpuBudget::parse_all(&["CUDA0=96GiB"]).unwrap(),
        kv: KvConfig { ctx: 131072, ..KvConfig::default() },
        ..PlanRequest::default()
    };
    let p = plan(&model, &req).unwrap();
    println!("{}", p.to_text(false));
    let gpu = p.device(Device::Cuda(0)).unwrap();
    assert!(gpu.total_bytes <= 95 * GIB, "margin kept: {}", gpu.total_bytes);
    assert!(p.fits);
    // Experts of a suffix of layers on the GPU, the rest on the CPU.
    let on_gpu = |l: u32| p.device_of(&format!("blk.{l}.ffn_up_exps.weight")) == Some(Device::Cuda(0));
    let first = (1..61).find(|&l| on_gpu(l)).unwrap();
    assert!((first..61).all(on_gpu) && !(1..first).any(on_gpu), "first GPU expert layer {first}");
    assert!(p.decisions.iter().any(|d| d.contains(&format!("as --n-cpu-moe {first}"))), "{:?}", p.decisions);
    assert_eq!(p.device_of("blk.1.attn_q_b.weight"), Some(Device::Cuda(0)));
}

/// The CPU's decompressed MLA (`--mla auto`, the default) counts on the CPU: its f32 copies of
/// attn_k_b and attn_v_b (64 heads x 512 x (128 + 128) x 4 bytes per layer at Kimi's shape) and
/// one layer's latents and rebuilt keys and values; nothing when the attention is on a GPU.
#[test]
fn decompressed_mla_memory_counts_on_the_cpu() {
    let (_dir, model) = open_replica(Ftype::Q4_K_M);
    let cpu_compute = |req: &PlanRequest| {
        let p = plan(&model, req).unwrap();
        p.devices.iter().find(|d| d.name == Device::Cpu).map(|d| d.compute_bytes).unwrap()
    };
    let ctx = 4096u64;
    let cpu_only = PlanRequest { kv: KvConfig { ctx: ctx as u32, ..KvConfig::default() }, ..PlanRequest::default() };
    let absorbed = PlanRequest { mla_decompressed: false, ..cpu_only.clone() };
    let weights = 61 * 64 * 512 * (128 + 128) * 4;
    let scratch = ctx * 576 * 4 + ctx * 64 * 256 * 4;
    assert_eq!(cpu_compute(&cpu_only) - cpu_compute(&absorbed), weights + scratch);
    // 128K cells: the rebuilt keys and values are capped (the heads go in groups).
    let long = PlanRequest { kv: KvConfig { ctx: 131072, ..KvConfig::default() }, ..PlanRequest::default() };
    let long_absorbed = PlanRequest { mla_decompressed: false, ..long.clone() };
    assert_eq!(cpu_compute(&long) - cpu_compute(&long_absorbed), weights + 131072 * 576 * 4 + (1 << 30));
    // Attention on the GPU: the CPU runs none of it.
    let gpu = issue_request();
    let gpu_absorbed = PlanRequest { mla_decompressed: false, ..issue_request() };
    assert_eq!(cpu_compute(&gpu), cpu_compute(&gpu_absorbed));
}
