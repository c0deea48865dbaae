//! The plot of the runs at size: throughput (items/s of batch_ingest, direct_apply, pg_upsert),
//! single_200rps's p99 and batch_ingest's p99 against stored conversions, uncapped, and beside
//! them the sizes run again with PostgreSQL under its memory budget (`capped`), as an SVG next
//! to report.md (plotters, SVG backend only).

use intake_tests::serde_json::Value;
use plotters::prelude::*;
use std::path::Path;

/// One series: its name and (stored conversions, value) points.
type Series = (String, Vec<(f64, f64)>);

fn series(report: &Value, sized: &[Value], scenario: &str, key: &str) -> Series {
    let mut points = vec![(0.0, report[scenario][key].as_f64().unwrap_or(0.0))];
    for row in sized {
        let label = row["label"].as_str().unwrap_or("");
        let size = row["size"].as_f64().unwrap_or(0.0);
        points.push((size, report[format!("{scenario}_{label}")][key].as_f64().unwrap_or(0.0)));
    }
    (scenario.to_owned(), points)
}

/// The sizes that also ran capped: their points, none at 0.
fn capped(report: &Value, sized: &[Value], scenario: &str, key: &str) -> Option<Series> {
    let points: Vec<(f64, f64)> = sized
        .iter()
        .filter(|row| !row["capped"].is_null())
        .map(|row| {
            let label = row["label"].as_str().unwrap_or("");
            let value = report[format!("{scenario}_{label}_capped")][key].as_f64().unwrap_or(0.0);
            (row["size"].as_f64().unwrap_or(0.0), value)
        })
        .collect();
    (!points.is_empty()).then(|| (format!("{scenario}, capped"), points))
}

/// Three panels side by side: throughput, the single sends' p99, and the batches' p99 (apart,
/// since a batch's p99 is a hundred times a single send's and would flatten it on one axis).
pub fn draw(report: &Value, sized: &[Value], path: &Path) -> anyhow::Result<()> {
    let with_capped = |scenarios: &[&str], key: &str| -> Vec<Series> {
        let mut all: Vec<Series> = scenarios.iter().map(|s| series(report, sized, s, key)).collect();
        all.extend(scenarios.iter().filter_map(|s| capped(report, sized, s, key)));
        all
    };
    let throughput = with_capped(&["batch_ingest", "direct_apply", "pg_upsert"], "items_per_s");
    let singles = with_capped(&["single_200rps"], "p99_ms");
    let batches = with_capped(&["batch_ingest"], "p99_ms");
    let root = SVGBackend::new(path, (1500, 420)).into_drawing_area();
    root.fill(&WHITE)?;
    let panels = root.split_evenly((1, 3));
    let max_x = sized.iter().filter_map(|r| r["size"].as_f64()).fold(1.0, f64::max);
    panel(&panels[0], "items/s against stored conversions", "items/s", &throughput, max_x)?;
    panel(&panels[1], "single_200rps p99 (ms) against stored conversions", "p99 ms", &singles, max_x)?;
    panel(&panels[2], "batch_ingest p99 (ms) against stored conversions", "p99 ms", &batches, max_x)?;
    root.present()?;
    Ok(())
}

fn panel(
    area: &DrawingArea<SVGBackend<'_>, plotters::coord::Shift>,
    title: &str,
    unit: &str,
    series: &[Series],
    max_x: f64,
) -> anyhow::Result<()> {
    let max_y = series.iter().flat_map(|(_, p)| p.iter().map(|(_, y)| *y)).fold(1.0, f64::max) * 1.15;
    let mut chart = ChartBuilder::on(area)
        .caption(title, ("sans-serif", 16))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..max_x * 1.05, 0.0..max_y)?;
    chart
        .configure_mesh()
        .x_desc("stored conversions")
        .y_desc(unit)
        .x_label_formatter(&|x| if *x >= 1e6 { format!("{:.0}M", x / 1e6) } else { format!("{:.0}k", x / 1e3) })
        .draw()?;
    for (index, (name, points)) in series.iter().enumerate() {
        let color = Palette99::pick(index).to_rgba();
        chart
            .draw_series(LineSeries::new(points.iter().copied(), color.stroke_width(2)))?
            .label(name.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], color.stroke_width(2)));
        chart.draw_series(points.iter().map(|&(x, y)| Circle::new((x, y), 3, color.filled())))?;
    }
    chart.configure_series_labels().background_style(WHITE.mix(0.8)).border_style(BLACK).draw()?;
    Ok(())
}
