//! Routed experts (llama.cpp `build_moe_ffn`): router logits, softmax or sigmoid gating, the
//! selection bias `exp_probs_b` (selection only), group-limited routing, top-k, weights from the
//! unbiased scores, optional normalization and scale, then `sum_k w_k * down_k(silu(gate_k x) * up_k x)`.

use crate::backend::{Backend, FfnSpec};
use crate::common::Ffn;
use crate::weights::{Weight, WeightLoader};
use crate::{model_err, Result};

/// `expert_gating_func` (llama.cpp `llama_expert_gating_func_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Gating {
    Softmax,
    Sigmoid,
}

impl Gating {
    /// From the GGUF value: 0 (none: softmax, as llama.cpp defaults for deepseek2), 1 softmax, 2 sigmoid.
    pub fn from_id(id: usize) -> Result<Gating> {
        match id {
            0 | 1 => Ok(Gating::Softmax),
            2 => Ok(Gating::Sigmoid),
            other => Err(model_err(format!("expert_gating_func {other} is not supported (1 softmax, 2 sigmoid)"))),
        }
    }
}

/// How tokens are routed.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Routing {
    pub n_expert: usize,
    pub n_used: usize,
    pub gating: Gating,
    pub norm_weights: bool,
    pub scale: f32,
    pub n_group: usize,
    pub n_group_used: usize,
}

pub(crate) struct Moe {
    gate_inp: Weight, // [n_embd] -> [n_expert]
    exp_probs_b: Option<Vec<f32>>,
    gate_exps: Weight, // per expert [n_embd] -> [n_ff]
    up_exps: Weight,   // per expert [n_embd] -> [n_ff]
    down_exps: Weight, // per expert [n_ff] -> [n_embd]
    n_embd: usize,
    n_ff: usize,
    r: Routing,
}

impl Moe {
    pub fn load(l: &WeightLoader, il: usize, n_embd: usize, n_ff: usize, r: Routing) -> Result<Moe> {
        if r.n_used == 0 || r.n_used > r.n_expert {
            return Err(model_err(format!("{} experts used of {}", r.n_used, r.n_expert)));
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
            exp_probs_b: l.opt_vec(&format!("blk.{il}.exp_probs_b.bias"), ne)?,
            gate_exps: l.get(&p("ffn_gate_exps"), &[n_embd, n_ff, ne])?,
            up_exps: l.get(&p("ffn_up_exps"), &[n_embd, n_ff, ne])?,
            down_exps: l.get(&p("ffn_down_exps"), &[n_ff, n_embd, ne])?,
            n_embd,
            n_ff,
            r,
        })
    }

    /// The experts chosen for one token's router logits and their weights, in selection order.
    pub fn route(&self, logits: &[f32]) -> Vec<(usize, f32)> {
        let r = &self.r;
        let probs: Vec<f32> = match r.gating {
            Gating::Softmax => {
                let mut p = logits.to_vec();
                tandem_cpu::softmax_in_place(&mut p);
                p
            }
            Gating::Sigmoid => logits.iter().map(|&x| 1.0 / (1.0 + (-x).exp())).collect(),
        };
        let mut sel: Vec<f32> = match &self.exp_probs_b {
            Some(b) => probs.iter().zip(b).map(|(p, b)| p + b).collect(),
            None => probs.clone(),
        };
        if r.n_group > 1 {
            // A group's score is the sum of its two best experts; keep the best groups only.
            let per = r.n_expert / r.n_group;
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
        if r.norm_weights {
            // Clamped to the smallest normal f16, as llama.cpp does.
            let sum = w.iter().sum::<f32>().max(6.103_515_6e-5);
            w.iter_mut().for_each(|x| *x /= sum);
        }
        if r.scale != 0.0 && r.scale != 1.0 {
            w.iter_mut().for_each(|x| *x *= r.scale);
        }
        chosen.into_iter().zip(w).collect()
    }

    /// The routed-expert output for `n` tokens of `h` (`[n][n_embd]`), plus the shared expert's
    /// when there is one: every expert runs once on all the tokens routed to it, and all of them
    /// (with the shared expert) in one [`Backend::ffn_batch`].
    pub fn forward(&self, b: &dyn Backend, h: &[f32], n: usize, shared: Option<&Ffn>) -> Result<Vec<f32>> {
        let (ne, nf) = (self.n_embd, self.n_ff);
        let mut logits = vec![0f32; n * self.r.n_expert];
        b.matmul(&self.gate_inp, h, &mut logits)?;
        let routes: Vec<Vec<(usize, f32)>> = logits.chunks_exact(self.r.n_expert).map(|l| self.route(l)).collect();
        let mut by_expert: Vec<Vec<(usize, usize)>> = vec![Vec::new(); self.r.n_expert];
        for (t, route) in routes.iter().enumerate() {
            for (slot, &(e, _)) in route.iter().enumerate() {
                by_expert[e].push((t, slot));
            }
        }
        let used: Vec<usize> = (0..self.r.n_expert).filter(|&e| !by_expert[e].is_empty()).collect();
        let mut specs: Vec<FfnSpec> = used
            .iter()
            .map(|&e| FfnSpec {
                gate: &self.gate_exps,
                up: &self.up_exps,
                down: &self.down_exps,
                expert: e,
                n_ff: nf,
                n_out: ne,
                tokens: by_expert[e].iter().map(|&(t, _)| t).collect(),
            })
            .collect();
        if let Some(s) = shared {
            specs.push(s.spec((0..n).collect()));
        }
        let outs = b.ffn_batch(h, ne, &specs)?;
        let n_used = self.r.n_used;
        // Where each (token, slot) output is: (index into `outs`, row within it).
        let mut at = vec![(0usize, 0usize); n * n_used];
        for (k, &e) in used.iter().enumerate() {
            for (i, &(t, slot)) in by_expert[e].iter().enumerate() {
                at[t * n_used + slot] = (k, i);
            }
        }
        // Each output scaled by its weight, summed in selection order as llama.cpp adds the expert
        // views, then the shared expert.
        let mut out = vec![0f32; n * ne];
        let mut scaled = vec![0f32; ne];
        for t in 0..n {
            let o = &mut out[t * ne..(t + 1) * ne];
            for slot in 0..n_used {
                let (k, i) = at[t * n_used + slot];
                let w = routes[t][slot].1;
                let dst = if slot == 0 { &mut *o } else { &mut scaled[..] };
                for (d, s) in dst.iter_mut().zip(&outs[k][i * ne..(i + 1) * ne]) {
                    *d = s * w;
                }
                if slot > 0 {
                    b.add(o, &scaled);
                }
            }
        }
        if shared.is_some() {
            if let Some(s) = outs.last() {
                b.add(&mut out, s);
            }
        }
        Ok(out)
    }
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
    use super::top_k;

    #[test]
    fn top_k_orders_by_value() {
        assert_eq!(top_k(&[0.1, 0.9, f32::NEG_INFINITY, 0.5], 2), [1, 3]);
    }
}
