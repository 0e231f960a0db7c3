//! The [`Runtime`]'s MoE kernels: expert selection from router logits, the packet of each token's
//! row, experts and weights, and the weighted sum of the experts' outputs.

use super::{grid, int, Runtime};
use crate::memory::DeviceBuffer;
use crate::{Error, Result, RouterParams, ROUTER_MAX_EXPERT};

/// The shape of a MoE packet: `n_tokens` rows, each a token's `n_embd` values, then its `n_used`
/// expert ids and weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Packet {
    pub n_tokens: usize,
    pub n_embd: usize,
    pub n_used: usize,
}

impl Packet {
    /// Values per row.
    pub fn row(&self) -> usize {
        self.n_embd + 2 * self.n_used
    }

    /// `n_embd`, `n_used` and the row as kernel arguments; None for no tokens (nothing to launch).
    fn ints(&self, what: &str) -> Result<Option<(i32, i32, i32)>> {
        if self.n_tokens == 0 {
            return Ok(None);
        }
        Ok(Some((int(self.n_embd, what)?, int(self.n_used, what)?, int(self.row(), what)?)))
    }
}

impl Runtime {
    /// Expert selection for `n_tokens` rows of router logits: `ids` and `weights` are
    /// `[n_tokens][n_used]`.
    pub fn router(
        &self,
        logits: &DeviceBuffer<f32>,
        bias: Option<&DeviceBuffer<f32>>,
        n_tokens: usize,
        p: &RouterParams,
        ids: &DeviceBuffer<i32>,
        weights: &DeviceBuffer<f32>,
    ) -> Result<()> {
        if p.n_used == 0
            || p.n_used > p.n_expert
            || p.n_expert > ROUTER_MAX_EXPERT
            || (p.n_group > 1
                && (!p.n_expert.is_multiple_of(p.n_group) || p.n_group_used == 0 || p.n_group_used > p.n_group))
        {
            return Err(Error::Shape(format!(
                "router: {} of {} experts in {} groups",
                p.n_used, p.n_expert, p.n_group
            )));
        }
        if n_tokens == 0 {
            return Ok(());
        }
        let lp = logits.at(0, n_tokens * p.n_expert, "router logits")?;
        let bp = match bias {
            Some(b) => b.at(0, p.n_expert, "router bias")?,
            None => 0,
        };
        let ip = ids.at(0, n_tokens * p.n_used, "router ids")?;
        let wp = weights.at(0, n_tokens * p.n_used, "router weights")?;
        let (ne, nu, gating) = (p.n_expert as i32, p.n_used as i32, p.gating as i32);
        let (ng, ngu, norm, scale) =
            (int(p.n_group, "router")?, int(p.n_group_used, "router")?, p.norm as i32, p.scale);
        self.launch(
            "tandem_router_f32",
            [grid(n_tokens)?, 1, 1],
            [32, 1, 1],
            &mut args![lp, bp, ne, nu, gating, ng, ngu, norm, scale, ip, wp],
        )
    }

    /// The packet `[n_tokens][n_embd + 2 n_used]` (`p`): each row of `h`, its expert ids (as f32),
    /// its weights.
    pub fn moe_pack(
        &self,
        h: &DeviceBuffer<f32>,
        ids: &DeviceBuffer<i32>,
        weights: &DeviceBuffer<f32>,
        packet: &DeviceBuffer<f32>,
        p: Packet,
    ) -> Result<()> {
        let Some((ne, nu, _)) = p.ints("moe_pack")? else { return Ok(()) };
        let hp = h.at(0, p.n_tokens * p.n_embd, "moe_pack h")?;
        let ip = ids.at(0, p.n_tokens * p.n_used, "moe_pack ids")?;
        let wp = weights.at(0, p.n_tokens * p.n_used, "moe_pack weights")?;
        let pp = packet.at(0, p.n_tokens * p.row(), "moe_pack packet")?;
        self.launch_rows("tandem_moe_pack_f32", p.n_tokens, &mut args![hp, ip, wp, pp, ne, nu])
    }

    /// `out[t] = sum over slots of weight * y[t][slot]` (weights from the packet, `p`), in slot
    /// order.
    pub fn moe_sum(
        &self,
        y: &DeviceBuffer<f32>,
        packet: &DeviceBuffer<f32>,
        out: &DeviceBuffer<f32>,
        p: Packet,
    ) -> Result<()> {
        let Some((ne, nu, pr)) = p.ints("moe_sum")? else { return Ok(()) };
        let yp = y.at(0, p.n_tokens * p.n_used * p.n_embd, "moe_sum y")?;
        let pp = packet.at(0, p.n_tokens * p.row(), "moe_sum packet")?;
        let op = out.at(0, p.n_tokens * p.n_embd, "moe_sum out")?;
        self.launch_rows("tandem_moe_sum_f32", p.n_tokens, &mut args![yp, pp, op, ne, nu, pr])
    }
}
