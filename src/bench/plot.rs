//! `tandem bench --plot`: the rows as an SVG chart.

use super::Row;
use std::path::Path;

/// S_PP (top) and S_TG (bottom) against N_KV, one line per thread count.
pub(super) fn plot(path: &Path, rows: &[Row], threads: &[usize], model: &str) -> anyhow::Result<()> {
    use plotters::prelude::*;
    let root = SVGBackend::new(path, (960, 800)).into_drawing_area();
    root.fill(&WHITE)?;
    let root = root.titled(&format!("tandem bench: {model}"), ("sans-serif", 18))?;
    let panels = root.split_evenly((2, 1));
    type Get = fn(&Row) -> Option<f64>;
    let series: [(&str, &str, Get); 2] = [("S_PP", "prefill", |r| r.s_pp_tps), ("S_TG", "decode", |r| r.s_tg_tps)];
    let x_max = rows.iter().map(|r| r.n_kv).max().unwrap_or(0).max(1) as f64;
    for (panel, (name, what, get)) in panels.iter().zip(series) {
        let y_max = rows.iter().filter_map(get).fold(0f64, f64::max).max(1e-3) * 1.15;
        let mut chart = ChartBuilder::on(panel)
            .caption(format!("{name}: {what} speed (tokens/s) against N_KV"), ("sans-serif", 16))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(70)
            .build_cartesian_2d(0f64..x_max * 1.02, 0f64..y_max)?;
        chart.configure_mesh().x_desc("N_KV (tokens in the KV cache)").y_desc(format!("{name} (tokens/s)")).draw()?;
        for (i, &t) in threads.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            let pts: Vec<(f64, f64)> =
                rows.iter().filter(|r| r.threads == t).filter_map(|r| get(r).map(|v| (r.n_kv as f64, v))).collect();
            if pts.is_empty() {
                continue;
            }
            chart
                .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))?
                .label(format!("{name} -t {t}"))
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
            chart.draw_series(pts.iter().map(|&p| Circle::new(p, 3, color.filled())))?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()?;
    }
    root.present()?;
    Ok(())
}
