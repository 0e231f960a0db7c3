//! Routed experts (llama.cpp `build_moe_ffn`): router logits, softmax or sigmoid gating, the
//! selection bias `exp_probs_b` (selection only), group-limited routing, top-k, weights from the
//! unbiased scores, optional normalization and scale, then `sum_k w_k * down_k(silu(gate_k x) * up_k x)`.

use crate::common::Ffn;
use crate::weights::{Vector, Weight, WeightLoader};
use crate::{model_err, Result};
use tandem_cpu::{CpuBackend, WeightRef};
pub use tandem_cuda::{Gating, RouterParams};

/// The gating of the GGUF's `expert_gating_func` (llama.cpp `llama_expert_gating_func_type`): 0
/// (none: softmax, as llama.cpp defaults for deepseek2), 1 softmax, 2 sigmoid.
pub(crate) fn gating_from_id(id: usize) -> Result<Gating> {
    match id {
        0 | 1 => Ok(Gating::Softmax),
        2 => Ok(Gating::Sigmoid),
        other => Err(model_err(format!("expert_gating_func {other} is not supported (1 softmax, 2 sigmoid)"))),
    }
}

/// A token's experts and their weights, in selection order.
pub(crate) type Route = Vec<(usize, f32)>;

pub(crate) struct Moe {
    gate_inp: Weight, // [n_embd] -> [n_expert]
    exp_probs_b: Option<Vector>,
    /// The stacked experts: per expert `[n_embd] -> [n_ff]` (gate, up) and `[n_ff] -> [n_embd]`.
    experts: Ffn,
    n_embd: usize,
    r: RouterParams,
}

/// Which experts run on which rows: `used[k] = (expert, rows)` in expert order, and for each
/// (row, slot) where its output is: `at[row * n_used + slot] = (k, index in used[k].1)`.
pub(crate) struct ExpertPlan {
    pub used: Vec<(usize, Vec<usize>)>,
    at: Vec<(usize, usize)>,
}

impl Moe {
    pub fn load(l: &WeightLoader, il: usize, n_embd: usize, n_ff: usize, r: RouterParams) -> Result<Moe> {
        if r.n_used == 0 || r.n_used > r.n_expert {
            return Err(model_err(format!(
                "expert_used_count = {}: must be between 1 and expert_count ({})",
                r.n_used, r.n_expert
            )));
        }
        if r.n_group > 1 && (!r.n_expert.is_multiple_of(r.n_group) || r.n_group_used == 0 || r.n_group_used > r.n_group)
        {
            return Err(model_err(format!(
                "expert groups: {} experts in {} groups, {} used",
                r.n_expert, r.n_group, r.n_group_used
            )));
        }
        let p = |n: &str| format!("blk.{il}.{n}.weight");
        let ne = r.n_expert;
        Ok(Moe {
            gate_inp: l.get(&p("ffn_gate_inp"), &[n_embd, ne])?,
            exp_probs_b: l.opt_vector(&format!("blk.{il}.exp_probs_b.bias"), ne)?,
            experts: Ffn {
                gate: l.get(&p("ffn_gate_exps"), &[n_embd, n_ff, ne])?,
                up: l.get(&p("ffn_up_exps"), &[n_embd, n_ff, ne])?,
                down: l.get(&p("ffn_down_exps"), &[n_ff, n_embd, ne])?,
                n_ff,
                n_out: n_embd,
            },
            n_embd,
            r,
        })
    }

    /// `ffn_gate_inp`.
    pub fn router(&self) -> &Weight {
        &self.gate_inp
    }

    pub fn router_name(&self) -> &str {
        &self.gate_inp.name
    }

    /// `exp_probs_b`, the selection bias.
    pub fn bias(&self) -> Option<&Vector> {
        self.exp_probs_b.as_ref()
    }

    pub fn routing(&self) -> &RouterParams {
        &self.r
    }

    /// The stacked expert matrices (`n_ff` rows of gate and up, `n_embd` of down, per expert).
    pub fn experts(&self) -> &Ffn {
        &self.experts
    }

    pub fn expert_names(&self) -> (&str, &str, &str) {
        (&self.experts.gate.name, &self.experts.up.name, &self.experts.down.name)
    }

    pub fn n_embd(&self) -> usize {
        self.n_embd
    }

    /// Values per row of a [`Moe::route_packet`]: the row, its experts' ids, their weights.
    pub fn packet_row(&self) -> usize {
        self.n_embd + 2 * self.r.n_used
    }

    /// The experts chosen for one token's router logits and their weights, in selection order.
    pub fn route(&self, logits: &[f32]) -> Vec<(usize, f32)> {
        route(logits, self.exp_probs_b.as_ref().map(|b| &b.v[..]), &self.r)
    }

    /// The routes of the rows of `h` (`[n][n_embd]`) on the CPU, with `router` the router's matrix.
    pub fn route_rows(&self, cpu: &CpuBackend, router: &WeightRef, h: &[f32]) -> Result<Vec<Route>> {
        let n = h.len() / self.n_embd.max(1);
        let mut logits = vec![0f32; n * self.r.n_expert];
        cpu.matmul(router, h, &mut logits).map_err(|e| model_err(format!("{}: {e}", self.gate_inp.name)))?;
        Ok(logits.chunks_exact(self.r.n_expert).map(|l| self.route(l)).collect())
    }

    /// [`Moe::route_rows`], packed with the rows: `[n][n_embd + 2 n_used]`, each row of `h`, then its
    /// experts' ids (as f32, exact below 2^24), then their weights.
    pub fn route_packet(&self, cpu: &CpuBackend, router: &WeightRef, h: &[f32]) -> Result<Vec<f32>> {
        let routes = self.route_rows(cpu, router, h)?;
        let (ne, nu) = (self.n_embd, self.r.n_used);
        let mut p = Vec::with_capacity(routes.len() * self.packet_row());
        for (t, route) in routes.iter().enumerate() {
            p.extend_from_slice(&h[t * ne..(t + 1) * ne]);
            p.extend(route.iter().map(|&(e, _)| e as f32));
            p.extend(route.iter().map(|&(_, w)| w));
            p.resize(p.len() + nu - route.len(), 0.0);
        }
        Ok(p)
    }

    /// The routes and rows of a packet of [`Moe::route_packet`] (made here or on another device);
    /// an expert id that is not one of this layer's is an error.
    pub fn unpack(&self, p: &[f32]) -> Result<(Vec<Route>, Vec<f32>)> {
        let (ne, nu, row) = (self.n_embd, self.r.n_used, self.packet_row());
        if !p.len().is_multiple_of(row) {
            return Err(model_err(format!("{}: a packet of {} values, rows of {row}", self.gate_inp.name, p.len())));
        }
        let n = p.len() / row;
        let mut h = Vec::with_capacity(n * ne);
        let mut routes = Vec::with_capacity(n);
        for r in p.chunks_exact(row) {
            h.extend_from_slice(&r[..ne]);
            let mut route = Vec::with_capacity(nu);
            for (&id, &w) in r[ne..ne + nu].iter().zip(&r[ne + nu..]) {
                if !(id >= 0.0 && id < self.r.n_expert as f32 && id.fract() == 0.0) {
                    return Err(model_err(format!("{}: expert id {id} routed", self.gate_inp.name)));
                }
                route.push((id as usize, w));
            }
            routes.push(route);
        }
        Ok((routes, h))
    }

    /// Which experts run on which rows for `routes`.
    pub fn plan(&self, routes: &[Route]) -> ExpertPlan {
        let mut by_expert: Vec<Vec<(usize, usize)>> = vec![Vec::new(); self.r.n_expert];
        for (t, route) in routes.iter().enumerate() {
            for (slot, &(e, _)) in route.iter().enumerate() {
                by_expert[e].push((t, slot));
            }
        }
        let n_used = self.r.n_used;
        let mut at = vec![(0usize, 0usize); routes.len() * n_used];
        let mut used = Vec::new();
        for (e, rows) in by_expert.iter().enumerate().filter(|(_, r)| !r.is_empty()) {
            for (i, &(t, slot)) in rows.iter().enumerate() {
                at[t * n_used + slot] = (used.len(), i);
            }
            used.push((e, rows.iter().map(|&(t, _)| t).collect()));
        }
        ExpertPlan { used, at }
    }

    /// Row `t` of the experts' outputs (`outs[k]` for `plan.used[k]`, `[rows][n_embd]`) scaled by
    /// their weights and summed in selection order into `o` (`n_embd` values), as llama.cpp adds
    /// the expert views: the first one's output times its weight, then each other's product added
    /// (`o + (s * w)`, two roundings, as ggml's scale then add).
    pub fn combine_row(&self, plan: &ExpertPlan, routes: &[Route], outs: &[Vec<f32>], t: usize, o: &mut [f32]) {
        let (ne, n_used) = (self.n_embd, self.r.n_used);
        for (slot, &(_, w)) in routes[t].iter().enumerate().take(n_used) {
            let (k, i) = plan.at[t * n_used + slot];
            let src = &outs[k][i * ne..(i + 1) * ne];
            if slot == 0 {
                o.iter_mut().zip(src).for_each(|(d, s)| *d = s * w);
            } else {
                o.iter_mut().zip(src).for_each(|(d, s)| *d += s * w);
            }
        }
    }
}

/// The experts chosen for one token's router logits and their weights, in selection order
/// (llama.cpp `build_moe_ffn`); `bias` (`exp_probs_b`) shifts the selection only. The CUDA
/// router kernel is checked against this.
pub fn route(logits: &[f32], bias: Option<&[f32]>, r: &RouterParams) -> Vec<(usize, f32)> {
    let probs: Vec<f32> = match r.gating {
        Gating::Softmax => {
            let mut p = logits.to_vec();
            tandem_cpu::softmax_in_place(&mut p);
            p
        }
        Gating::Sigmoid => logits.iter().map(|&x| 1.0 / (1.0 + (-x).exp())).collect(),
    };
    let mut sel: Vec<f32> = match bias {
        Some(b) => probs.iter().zip(b).map(|(p, b)| p + b).collect(),
        None => probs.clone(),
    };
    // Groups of 0 experts (`n_group > n_expert`, which `Moe::load` refuses) select no groups.
    let per = r.n_expert / r.n_group.max(1);
    if r.n_group > 1 && per > 0 {
        // A group's score is the sum of its two best experts; keep the best groups only.
        let scores: Vec<f32> = sel.chunks(per).map(|g| top_k(g, 2.min(per)).iter().map(|&i| g[i]).sum()).collect();
        let keep = top_k(&scores, r.n_group_used);
        for (g, chunk) in sel.chunks_mut(per).enumerate() {
            if !keep.contains(&g) {
                chunk.fill(f32::NEG_INFINITY);
            }
        }
    }
    let chosen = top_k(&sel, r.n_used);
    let mut w: Vec<f32> = chosen.iter().map(|&e| probs[e]).collect();
    if r.norm {
        // Clamped to the smallest normal f16, as llama.cpp does.
        let sum = w.iter().sum::<f32>().max(6.103_515_6e-5);
        w.iter_mut().for_each(|x| *x /= sum);
    }
    if r.scale != 0.0 && r.scale != 1.0 {
        w.iter_mut().for_each(|x| *x *= r.scale);
    }
    chosen.into_iter().zip(w).collect()
}

/// Indices of the `k` largest values, largest first (ties: lower index first).
fn top_k(v: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..v.len()).collect();
    idx.sort_by(|&a, &b| v[b].total_cmp(&v[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

#[cfg(test)]
mod tests {
    use super::{route, top_k, Gating, RouterParams};

    /// Parameters no loaded model has (more groups than experts) give a route, not a panic.
    #[test]
    fn unvalidated_groups_do_not_panic() {
        let logits: Vec<f32> = (0..8).map(|i| i as f32 * 0.1).collect();
        let r = RouterParams {
            n_expert: 8,
            n_used: 2,
            gating: Gating::Sigmoid,
            n_group: 16,
            n_group_used: 3,
            norm: true,
            scale: 1.0,
        };
        let got = route(&logits, None, &r);
        assert_eq!(got.iter().map(|&(e, _)| e).collect::<Vec<_>>(), vec![7, 6]);
        assert!(route(&[], None, &RouterParams { n_expert: 0, ..r }).is_empty());
    }

    #[test]
    fn top_k_orders_by_value() {
        assert_eq!(top_k(&[0.1, 0.9, f32::NEG_INFINITY, 0.5], 2), [1, 3]);
    }
}
