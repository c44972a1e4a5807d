//! SVG charts of the report: decode and prefill throughput against batch size (test 1) and
//! the latency CDFs of the concurrent clients (test 6).

use super::report::Section;
use anyhow::{anyhow, Result};
use plotters::prelude::*;
use serde_json::Value;
use std::path::Path;

const COLORS: [RGBColor; 5] = [BLUE, RED, GREEN, MAGENTA, BLACK];

/// One line of a chart: its label and points.
type Series = (String, Vec<(f64, f64)>);

/// Writes the charts whose tests produced figures; returns (title, path relative to the
/// report) for each.
pub fn write(dir: &Path, sections: &[Section]) -> Result<Vec<(&'static str, String)>> {
    let mut written = vec![];
    if let Some(s) = sections
        .iter()
        .find(|s| s.number == 1 && s.figures.is_array())
    {
        for (key, title, file) in [
            (
                "decode_tok_s",
                "decode tok/s vs batch size",
                "decode_vs_batch.svg",
            ),
            (
                "prefill_tok_s",
                "prefill tok/s vs batch size",
                "prefill_vs_batch.svg",
            ),
        ] {
            line_chart(
                &dir.join(file),
                title,
                "batch size",
                "tok/s",
                &by_prompt(&s.figures, key),
            )?;
            written.push((title, format!("charts/{file}")));
        }
    }
    if let Some(s) = sections
        .iter()
        .find(|s| s.number == 6 && s.figures.is_object())
    {
        let cdf = |key: &str| -> Vec<(f64, f64)> {
            let mut v: Vec<f64> = s.figures[key]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(Value::as_f64)
                .collect();
            v.sort_by(f64::total_cmp);
            let n = v.len() as f64;
            v.into_iter()
                .enumerate()
                .map(|(i, x)| (x, (i + 1) as f64 / n))
                .collect()
        };
        let series = vec![
            ("TTFT".to_string(), cdf("ttft_samples_ms")),
            ("end-to-end".to_string(), cdf("e2el_samples_ms")),
        ];
        if series.iter().all(|s| !s.1.is_empty()) {
            let title = "latency CDF of the concurrent clients";
            line_chart(
                &dir.join("latency_cdf.svg"),
                title,
                "ms",
                "fraction of requests",
                &series,
            )?;
            written.push((title, "charts/latency_cdf.svg".to_string()));
        }
    }
    Ok(written)
}

/// `key` against batch size, one line per prompt length.
fn by_prompt(figures: &Value, key: &str) -> Vec<Series> {
    let mut series: Vec<Series> = vec![];
    for f in figures.as_array().into_iter().flatten() {
        let (Some(prompt), Some(batch), Some(y)) =
            (f["prompt"].as_u64(), f["batch"].as_f64(), f[key].as_f64())
        else {
            continue;
        };
        let label = format!("prompt {prompt}");
        match series.iter_mut().find(|s| s.0 == label) {
            Some(s) => s.1.push((batch, y)),
            None => series.push((label, vec![(batch, y)])),
        }
    }
    series
}

fn line_chart(
    path: &Path,
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[Series],
) -> Result<()> {
    let points = series.iter().flat_map(|s| &s.1);
    let x_max = points.clone().map(|p| p.0).fold(0.0, f64::max) * 1.05;
    let y_max = points.map(|p| p.1).fold(0.0, f64::max) * 1.1;
    let root = SVGBackend::new(path, (720, 440)).into_drawing_area();
    root.fill(&WHITE)
        .map_err(|e| anyhow!("drawing {}: {e:?}", path.display()))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(64)
        .build_cartesian_2d(0.0..x_max.max(1.0), 0.0..y_max.max(1.0))
        .map_err(|e| anyhow!("drawing {}: {e:?}", path.display()))?;
    chart
        .configure_mesh()
        .x_desc(x_label)
        .y_desc(y_label)
        .draw()
        .map_err(|e| anyhow!("drawing {}: {e:?}", path.display()))?;
    for (i, (label, pts)) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        chart
            .draw_series(LineSeries::new(pts.iter().copied(), color.stroke_width(2)))
            .map_err(|e| anyhow!("drawing {}: {e:?}", path.display()))?
            .label(label.clone())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 16, y)], color.stroke_width(2))
            });
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::LowerRight)
        .draw()
        .map_err(|e| anyhow!("drawing {}: {e:?}", path.display()))?;
    root.present()
        .map_err(|e| anyhow!("writing {}: {e:?}", path.display()))?;
    Ok(())
}
