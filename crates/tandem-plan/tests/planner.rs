//! Rule semantics, `-ngl`, `--n-cpu-moe`, `--fit`, the KV cache and the JSON shape, end to end on
//! the tiny deepseek2 / llama fixtures (3 layers: layer 0 dense, layers 1-2 MoE; MLA or legacy).

use std::path::PathBuf;
use tandem_gguf::{GgmlType, GgufModel, LoadOptions, TensorCategory};
use tandem_plan::{plan, Device, GpuBudget, GpuLayers, KvConfig, ModelInfo, Plan, PlanRequest, Rule, MIB};

const CPU: Device = Device::Cpu;
const GPU0: Device = Device::Cuda(0);

fn model(name: &str) -> ModelInfo {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/models").join(name);
    let gguf = GgufModel::open(&path, LoadOptions::default()).unwrap();
    ModelInfo::from_gguf(&gguf, name).unwrap()
}

fn mla() -> ModelInfo {
    model("deepseek2-mla-tiny-Q4_K_M.gguf")
}

fn req(gpus: &[&str], ot: &[&str], ngl: Option<u32>) -> PlanRequest {
    PlanRequest {
        gpus: GpuBudget::parse_all(gpus).unwrap(),
        rules: Rule::parse_overrides(ot).unwrap(),
        n_gpu_layers: ngl.map(GpuLayers::Count),
        ..PlanRequest::default()
    }
}

fn dev(p: &Plan, name: &str) -> Device {
    p.device_of(name).unwrap_or_else(|| panic!("no tensor {name}"))
}

#[test]
fn first_matching_rule_wins_in_command_line_order() {
    let m = mla();
    let p = plan(&m, &req(&["CUDA0=8GiB"], &[r"blk\.1\.=CUDA0", "ffn_up_exps=CPU"], Some(0))).unwrap();
    assert_eq!(dev(&p, "blk.1.ffn_up_exps.weight"), GPU0, "the earlier rule wins");
    assert_eq!(dev(&p, "blk.2.ffn_up_exps.weight"), CPU);
    assert_eq!(dev(&p, "blk.2.attn_q_b.weight"), CPU, "-ngl 0");
    // Reversed order: the experts rule now comes first.
    let p = plan(&m, &req(&["CUDA0=8GiB"], &["ffn_up_exps=CPU", r"blk\.1\.=CUDA0"], Some(0))).unwrap();
    assert_eq!(dev(&p, "blk.1.ffn_up_exps.weight"), CPU);
    assert_eq!(dev(&p, "blk.1.ffn_down_exps.weight"), GPU0);
    // A rule whose every match an earlier rule took is reported.
    let p = plan(&m, &req(&["CUDA0=8GiB"], &["exps=CPU", "ffn_up_exps=CUDA0"], Some(999))).unwrap();
    assert_eq!(
        p.warnings,
        ["--override-tensor 'ffn_up_exps=CUDA0': every tensor it matches was already placed by an earlier rule"]
    );
}

#[test]
fn overrides_beat_n_gpu_layers() {
    let m = mla();
    let p = plan(&m, &req(&["CUDA0=8GiB"], &["exps=CPU"], Some(999))).unwrap();
    for t in &p.tensors {
        let want = if t.category == TensorCategory::RoutedExperts { CPU } else { GPU0 };
        assert_eq!(t.device, want, "{}", t.name);
    }
    let p = plan(&m, &req(&["CUDA0=8GiB"], &["attn_=CUDA0"], Some(0))).unwrap();
    assert_eq!(dev(&p, "blk.0.attn_kv_a_mqa.weight"), GPU0);
    assert_eq!(dev(&p, "blk.0.ffn_gate.weight"), CPU);
    // The KV cache follows the layer's attention, wherever a rule put it.
    assert_eq!(p.device(GPU0).unwrap().kv_bytes, p.kv.bytes);
}

#[test]
fn n_gpu_layers_counts_from_the_output_end() {
    let m = mla();
    let p = plan(&m, &req(&["CUDA0=8GiB"], &[], Some(1))).unwrap();
    assert_eq!(dev(&p, "output.weight"), GPU0);
    assert_eq!(dev(&p, "output_norm.weight"), GPU0);
    assert_eq!(dev(&p, "blk.2.attn_norm.weight"), CPU);
    let p = plan(&m, &req(&["CUDA0=8GiB"], &[], Some(2))).unwrap();
    assert_eq!(dev(&p, "blk.2.ffn_up_exps.weight"), GPU0);
    assert_eq!(dev(&p, "blk.1.ffn_up_exps.weight"), CPU);
    assert_eq!(dev(&p, "token_embd.weight"), CPU, "the embeddings follow layer 0");
    assert_eq!(p.decisions[0], "--n-gpu-layers 2: layers 0-1 on CPU, layer 2 on CUDA0, the output head on CUDA0");
    let p = plan(&m, &req(&["CUDA0=8GiB"], &[], Some(4))).unwrap();
    assert!(p.tensors.iter().all(|t| t.device == GPU0));
}

#[test]
fn n_cpu_moe_boundaries() {
    let m = mla();
    let on_cpu = |n: u32| -> Vec<u32> {
        let r = PlanRequest { rules: vec![Rule::n_cpu_moe(n)], ..req(&["CUDA0=8GiB"], &[], Some(999)) };
        let p = plan(&m, &r).unwrap();
        (1..3).filter(|l| dev(&p, &format!("blk.{l}.ffn_gate_exps.weight")) == CPU).collect()
    };
    assert_eq!(on_cpu(0), Vec::<u32>::new());
    assert_eq!(on_cpu(1), Vec::<u32>::new(), "layer 0 is dense: its FFN is no routed expert");
    assert_eq!(on_cpu(2), [1]);
    assert_eq!(on_cpu(3), [1, 2]);
    assert_eq!(on_cpu(99), [1, 2]);
    let r = PlanRequest { rules: vec![Rule::n_cpu_moe(1)], ..req(&["CUDA0=8GiB"], &[], Some(999)) };
    assert_eq!(plan(&m, &r).unwrap().warnings, ["--n-cpu-moe 1: matches no tensor"]);
    let r = PlanRequest { rules: vec![Rule::cpu_moe()], ..req(&["CUDA0=8GiB"], &[], Some(999)) };
    let p = plan(&m, &r).unwrap();
    assert_eq!(p.device(CPU).unwrap().weights_bytes, p.device(CPU).unwrap().by_category.routed_experts);
    assert!(p.device(CPU).unwrap().weights_bytes > 0);
}

#[test]
fn unknown_device_and_conflicts_are_errors() {
    let m = mla();
    let e = plan(&m, &req(&["CUDA0=8GiB"], &["exps=CUDA1"], Some(999))).unwrap_err().to_string();
    assert_eq!(e, "--override-tensor 'exps=CUDA1': unknown device 'CUDA1'; available: CUDA0, CPU");
    let e = plan(&m, &req(&[], &["exps=CUDA0"], None)).unwrap_err().to_string();
    assert_eq!(
        e,
        "--override-tensor 'exps=CUDA0': unknown device 'CUDA0'; available: CPU (declare GPUs with --gpu CUDA0=SIZE)"
    );
    let r = PlanRequest { fit: Some(true), ..req(&["CUDA0=8GiB"], &[], Some(10)) };
    assert!(plan(&m, &r).unwrap_err().to_string().starts_with("--fit on and --n-gpu-layers"));
}

#[test]
fn no_gpu_keeps_everything_on_the_cpu_and_says_so() {
    let p = plan(&mla(), &req(&[], &["exps=CPU"], Some(999))).unwrap();
    assert!(p.tensors.iter().all(|t| t.device == CPU));
    assert_eq!(p.warnings, ["--n-gpu-layers: no GPU declared (--gpu CUDA0=SIZE), so every layer stays on the CPU"]);
    assert_eq!(p.devices.len(), 1);
}

#[test]
fn kv_cache_sizes_follow_llama_cpp() {
    let kv = |m: &ModelInfo, ctx: u32, k: GgmlType, v: GgmlType, np: u32| {
        let r = PlanRequest {
            kv: KvConfig { ctx, type_k: k, type_v: v, parallel: np, offload: true },
            ..req(&[], &[], None)
        };
        plan(m, &r).unwrap().kv
    };
    let (f16, q8) = (GgmlType::F16, GgmlType::Q8_0);
    // MLA: 3 layers x (kv_lora 128 + rope 64) per token, K only; -ctv changes nothing.
    let m = mla();
    assert_eq!(kv(&m, 1024, f16, f16, 1).bytes, 3 * 192 * 2 * 1024);
    assert_eq!(kv(&m, 1024, f16, q8, 1).bytes, 3 * 192 * 2 * 1024);
    assert_eq!(kv(&m, 1024, q8, f16, 1).bytes, 3 * (192 / 32 * 34) * 1024);
    assert_eq!(kv(&m, 1024, f16, f16, 1).type_v, None);
    // -c is shared by the -np sequences, not multiplied; 1000 pads to 1024.
    assert_eq!(kv(&m, 1000, f16, f16, 4).bytes, kv(&m, 1024, f16, f16, 1).bytes);
    assert_eq!(kv(&m, 1024, f16, f16, 4).cells_per_sequence, 256);
    // Legacy attn_kv_b layout: 4 KV heads x 128 for K and 4 x 64 for V.
    let legacy = model("deepseek2-legacy-tiny.gguf");
    assert_eq!(kv(&legacy, 1024, f16, f16, 1).bytes, 3 * (512 + 256) * 2 * 1024);
    assert_eq!(kv(&legacy, 1024, f16, q8, 1).bytes, 3 * (512 * 2 + 256 / 32 * 34) * 1024);
    // llama: 2 layers x 2 KV heads x 64 for K and V; -c 0 is the training context (2048).
    let llama = model("llama-tiny.gguf");
    assert_eq!(kv(&llama, 0, f16, f16, 1).bytes, 2 * (128 + 128) * 2 * 2048);
}

#[test]
fn no_kv_offload_keeps_the_cache_on_the_cpu() {
    let mut r = req(&["CUDA0=8GiB"], &["exps=CPU"], Some(999));
    r.kv.offload = false;
    let p = plan(&mla(), &r).unwrap();
    assert_eq!(p.device(CPU).unwrap().kv_bytes, p.kv.bytes);
    assert_eq!(p.device(GPU0).unwrap().kv_bytes, 0);
}

#[test]
fn fit_takes_non_experts_first_then_expert_layers_from_the_end() {
    let m = mla();
    let exps = |l: u32| {
        m.tensors
            .iter()
            .filter(|t| t.layer == Some(l) && t.category == TensorCategory::RoutedExperts)
            .map(|t| t.bytes)
            .sum::<u64>()
    };
    let base: u64 = m.tensors.iter().filter(|t| t.category != TensorCategory::RoutedExperts).map(|t| t.bytes).sum();
    let probe = plan(&m, &PlanRequest { fit_margin: 0, ..req(&["CUDA0=1GiB"], &[], None) }).unwrap();
    assert!(probe.tensors.iter().all(|t| t.device == GPU0), "a 1 GiB GPU holds the tiny model");
    let gpu = probe.device(GPU0).unwrap();
    // A budget with room for the base, the KV cache, both compute buffers and layer 2's experts only.
    let budget = base + probe.kv.bytes + gpu.compute_bytes + exps(2) + 1024;
    let r = PlanRequest { fit_margin: 0, gpus: vec![GpuBudget { device: GPU0, bytes: budget }], ..req(&[], &[], None) };
    let p = plan(&m, &r).unwrap();
    assert_eq!(dev(&p, "blk.2.ffn_up_exps.weight"), GPU0);
    assert_eq!(dev(&p, "blk.1.ffn_up_exps.weight"), CPU);
    assert_eq!(dev(&p, "blk.1.ffn_up_shexp.weight"), GPU0);
    assert!(p.decisions.iter().any(|d| d.ends_with("(as --n-cpu-moe 2)")), "{:#?}", p.decisions);
    assert!(p.fits);
    // The margin is kept: the same budget with a 1 MiB margin leaves every expert on the CPU.
    let r = PlanRequest { fit_margin: MIB, ..r };
    assert_eq!(dev(&plan(&m, &r).unwrap(), "blk.2.ffn_up_exps.weight"), CPU);
}

/// The runtime multiplies on a GPU only the types it has a CUDA kernel for; the plan keeps the
/// matrices of any other type on the CPU, whatever `-ngl`, `-ot` or `--fit` would say.
#[test]
fn matrices_without_a_cuda_kernel_stay_on_the_cpu() {
    let mut m = mla();
    for t in m.tensors.iter_mut() {
        if t.name.contains("_shexp.") {
            t.ty = GgmlType::Q2_K;
        } else if t.name == "blk.2.ffn_down_exps.weight" {
            t.ty = GgmlType::IQ1_S;
        }
    }
    let shexp: u64 = m.tensors.iter().filter(|t| t.name.contains("_shexp.")).map(|t| t.bytes).sum();
    let moved = shexp + m.tensors.iter().find(|t| t.name == "blk.2.ffn_down_exps.weight").unwrap().bytes;
    // the caller says which types its GPU runtime multiplies (tandem: tandem-cuda's MATVEC_TYPES)
    let req = |gpus: &[&str], ot: &[&str], ngl: Option<u32>| PlanRequest {
        gpu_types: Some({
            use GgmlType::*;
            vec![F32, F16, BF16, Q4_0, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_XS]
        }),
        ..req(gpus, ot, ngl)
    };
    let all = plan(&mla(), &req(&["CUDA0=1GiB"], &[], Some(999))).unwrap();
    let p = plan(&m, &req(&["CUDA0=1GiB"], &[], Some(999))).unwrap();
    assert_eq!(dev(&p, "blk.1.ffn_up_shexp.weight"), CPU);
    assert_eq!(dev(&p, "blk.2.ffn_down_exps.weight"), CPU);
    assert_eq!(dev(&p, "blk.2.ffn_up_exps.weight"), GPU0);
    assert_eq!(dev(&p, "blk.1.ffn_norm.weight"), GPU0, "vectors are not multiplied");
    assert_eq!(p.device(CPU).unwrap().weights_bytes, moved);
    assert_eq!(p.device(GPU0).unwrap().weights_bytes, all.device(GPU0).unwrap().weights_bytes - moved);
    assert!(
        p.decisions.contains(
            &"no CUDA kernel for q2_K x 6, iq1_s x 1: those 7 matrices (TOTAL) run on the CPU"
                .replace("TOTAL", &tandem_plan::human(moved))
        ),
        "{:#?}",
        p.decisions
    );
    assert!(p.warnings.is_empty(), "{:?}", p.warnings);
    // A rule naming the GPU does not change that, and is warned about.
    let p = plan(&m, &req(&["CUDA0=1GiB"], &["shexp=CUDA0"], Some(999))).unwrap();
    assert_eq!(dev(&p, "blk.2.ffn_gate_shexp.weight"), CPU);
    assert_eq!(
        p.warnings,
        ["6 matrices a rule sent to a GPU (first blk.1.ffn_down_shexp.weight) have a type with no CUDA kernel: they run on the CPU"]
    );
    // --fit spends no GPU memory on them, and says nothing of experts it never considered.
    let p = plan(&m, &PlanRequest { fit_margin: 0, ..req(&["CUDA0=1GiB"], &[], None) }).unwrap();
    assert_eq!(p.device(CPU).unwrap().weights_bytes, moved);
    assert_eq!(dev(&p, "blk.1.ffn_up_exps.weight"), GPU0);
    // Without a GPU nothing is said.
    let p = plan(&m, &req(&[], &[], None)).unwrap();
    assert!(!p.decisions.iter().any(|d| d.contains("CUDA kernel")), "{:#?}", p.decisions);
}

#[test]
fn over_budget_gpu_does_not_fit() {
    let p = plan(&mla(), &req(&["CUDA0=1MiB"], &[], Some(999))).unwrap();
    assert!(!p.fits);
    assert!(p.warnings[0].starts_with("CUDA0: needs "), "{:?}", p.warnings);
}

#[test]
fn totals_equal_the_headers_for_every_fixture() {
    for name in
        ["deepseek2-mla-tiny.gguf", "deepseek2-legacy-tiny.gguf", "llama-tiny.gguf", "split-tiny-00002-of-00003.gguf"]
    {
        let m = model(name);
        let p = plan(&m, &req(&["CUDA0=8GiB"], &["exps=CPU"], None)).unwrap();
        let sum: u64 = p.devices.iter().map(|d| d.weights_bytes).sum();
        assert_eq!(sum, m.total_bytes(), "{name}");
        for d in &p.devices {
            assert_eq!(d.by_category.total(), d.weights_bytes, "{name} {}", d.name);
            assert_eq!(d.total_bytes, d.weights_bytes + d.kv_bytes + d.compute_bytes);
        }
        assert_eq!(p.tensors.len(), m.tensors.len());
    }
}

#[test]
fn json_has_the_issue_shape() {
    let p = plan(&mla(), &req(&["CUDA0=96GiB"], &["exps=CPU"], Some(999))).unwrap();
    let v: serde_json::Value = serde_json::from_str(&p.to_json()).unwrap();
    let d0 = &v["devices"][0];
    assert_eq!(d0["name"], "CUDA0");
    assert_eq!(d0["budget_bytes"], 96u64 << 30);
    for k in ["weights_bytes", "kv_bytes", "compute_bytes"] {
        assert!(d0[k].is_u64(), "{k}");
    }
    for k in ["attention", "routed_experts", "shared_experts", "dense_ffn", "embeddings_output", "norms_router"] {
        assert!(d0["by_category"][k].is_u64(), "{k}");
    }
    assert_eq!(v["devices"][1]["name"], "CPU");
    let t = &v["tensors"][0];
    assert!(t["name"].is_string() && t["device"].is_string() && t["bytes"].is_u64());
    assert_eq!(v["fits"], true);
}
