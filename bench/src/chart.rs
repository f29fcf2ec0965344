//! The PNG: each path's median ratio to direct as a bar, min–max as a whisker, the target as a
//! red tick. Left: higher is better; right: lower is better. The fast path at size is labelled "at
//! size" (its size in the footer). Drawn with plotters on a bitmap, with
//! DejaVu Sans embedded (crate `dejavu`), so it renders the same on a machine without fonts.
use std::path::Path;

use anyhow::{Context, Result, anyhow};
use plotters::prelude::*;
use plotters::style::{
    FontStyle, register_font,
    text_anchor::{HPos, Pos, VPos},
};

use super::model::{Metric, Results, Route};
use super::synthetic::AT_SIZE;
use super::targets::RATIO_TARGETS;

const WIDTH: u32 = 1720;
const ROW: i32 = 30;
const TOP: i32 = 90;
const PANEL: i32 = 860;
/// Room for the longest label (`throughput, 8 streams · passthrough (default: fast path)`).
const LABELS: i32 = 350;
const PLOT: i32 = 430;

struct Bar {
    label: String,
    route: Route,
    median: f64,
    min: f64,
    max: f64,
    target: Option<f64>,
}

pub(crate) fn draw(results: &Results, title: &str, path: &Path) -> Result<()> {
    register_font("sans-serif", FontStyle::Normal, dejavu::sans::regular())
        .map_err(|_| anyhow!("the embedded DejaVu Sans font did not load"))?;
    let higher = bars(
        results,
        &[
            (
                Metric::Throughput1,
                &[
                    Route::Service,
                    Route::Passthrough,
                    Route::ServiceCopy,
                    Route::PassthroughCopy,
                    Route::FastService,
                    Route::FastPassthrough,
                    Route::FastServiceAtSize,
                    Route::FastPassthroughAtSize,
                ][..],
            ),
            (
                Metric::Throughput8,
                &[
                    Route::Service,
                    Route::Passthrough,
                    Route::ServiceCopy,
                    Route::PassthroughCopy,
                    Route::FastService,
                    Route::FastPassthrough,
                    Route::FastServiceAtSize,
                    Route::FastPassthroughAtSize,
                ][..],
            ),
            (
                Metric::ConnRate,
                &[
                    Route::Service,
                    Route::Passthrough,
                    Route::FastService,
                    Route::FastPassthrough,
                    Route::FastServiceAtSize,
                    Route::FastPassthroughAtSize,
                ][..],
            ),
            (
                Metric::DnsQps,
                &[Route::DnsForwarded, Route::DnsCached, Route::DnsAnswered][..],
            ),
        ],
    );
    let lower = bars(
        results,
        &[
            (
                Metric::LatencyP50,
                &[
                    Route::Service,
                    Route::Passthrough,
                    Route::FastService,
                    Route::FastPassthrough,
                    Route::FastServiceAtSize,
                    Route::FastPassthroughAtSize,
                ][..],
            ),
            (
                Metric::LatencyP99,
                &[
                    Route::Service,
                    Route::Passthrough,
                    Route::FastService,
                    Route::FastPassthrough,
                    Route::FastServiceAtSize,
                    Route::FastPassthroughAtSize,
                ][..],
            ),
            (
                Metric::LatencyP999,
                &[
                    Route::Service,
                    Route::Passthrough,
                    Route::FastService,
                    Route::FastPassthrough,
                    Route::FastServiceAtSize,
                    Route::FastPassthroughAtSize,
                ][..],
            ),
            (
                Metric::DnsLatency,
                &[Route::DnsForwarded, Route::DnsCached, Route::DnsAnswered][..],
            ),
        ],
    );
    let rows = higher.len().max(lower.len()) as i32;
    let height = (TOP + rows * ROW + 100) as u32;
    let root = BitMapBackend::new(path, (WIDTH, height)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow!("{e}"))?;
    let text = |size: i32| ("sans-serif", size).into_font();
    root.draw(&Text::new(title, (20, 15), text(26)))
        .map_err(|e| anyhow!("{e}"))?;
    panel(
        &root,
        0,
        "higher is better (throughput, connections/s, DNS queries/s)",
        &higher,
        rows,
        2.0,
    )?;
    panel(&root, PANEL, "lower is better (latency)", &lower, rows, 4.0)?;
    root.present()
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

fn bars(results: &Results, groups: &[(Metric, &[Route])]) -> Vec<Bar> {
    let mut out = Vec::new();
    for (metric, routes) in groups {
        for route in *routes {
            let Some(r) = results.ratio(*metric, *route) else {
                continue;
            };
            let target = RATIO_TARGETS
                .iter()
                .find(|(m, _, _)| m == metric)
                .filter(|_| matches!(route, Route::Service | Route::Passthrough))
                .map(|(_, bound, _)| *bound);
            out.push(Bar {
                label: format!("{} · {}", metric.label(), label(*route)),
                route: *route,
                median: r.median,
                min: r.min,
                max: r.max,
                target,
            });
        }
    }
    out
}

/// The route's name on a bar: the rows at size named short.
fn label(route: Route) -> &'static str {
    match route {
        Route::FastServiceAtSize => "service (fast path, at size)",
        Route::FastPassthroughAtSize => "passthrough (fast path, at size)",
        other => other.label(),
    }
}

fn color(route: Route) -> RGBColor {
    match route {
        Route::Service => RGBColor(31, 119, 180),
        Route::ServiceCopy => RGBColor(158, 202, 225),
        Route::Passthrough => RGBColor(255, 127, 14),
        Route::PassthroughCopy => RGBColor(253, 208, 162),
        Route::FastService => RGBColor(148, 103, 189),
        Route::FastPassthrough => RGBColor(214, 39, 40),
        Route::FastServiceAtSize => RGBColor(197, 176, 213),
        Route::FastPassthroughAtSize => RGBColor(255, 152, 150),
        Route::DnsAnswered => RGBColor(44, 160, 44),
        Route::DnsCached => RGBColor(23, 190, 207),
        _ => RGBColor(150, 150, 150),
    }
}

fn panel(
    root: &DrawingArea<BitMapBackend, plotters::coord::Shift>,
    left: i32,
    heading: &str,
    bars: &[Bar],
    rows: i32,
    cap: f64,
) -> Result<()> {
    let err = |e: DrawingAreaErrorKind<_>| anyhow!("{e}");
    let font = |size: i32| ("sans-serif", size).into_font();
    root.draw(&Text::new(heading, (left + 20, 55), font(18)))
        .map_err(err)?;
    // The scale fits the bars up to `cap`: a whisker beyond it (one noisy p99.9 run) is cut at the edge.
    let scale_max = bars
        .iter()
        .flat_map(|b| [b.max, b.target.unwrap_or(0.0)])
        .fold(1.25_f64, f64::max)
        .min(cap);
    let step = if scale_max > 2.0 { 0.5 } else { 0.25 };
    let scale_max = (scale_max / step).ceil() * step;
    let x0 = left + LABELS;
    let x = |v: f64| x0 + (v.min(scale_max) / scale_max * f64::from(PLOT)) as i32;
    let bottom = TOP + rows * ROW;
    // A grid line every step (labels every other one), and the direct line at 1.
    let mut tick = 0.0;
    while tick <= scale_max + 1e-9 {
        let major = (tick / (2.0 * step)).fract().abs() < 1e-9;
        let shade = if major { 215 } else { 238 };
        root.draw(&PathElement::new(
            vec![(x(tick), TOP - 5), (x(tick), bottom)],
            RGBColor(shade, shade, shade),
        ))
        .map_err(err)?;
        if major {
            root.draw(&Text::new(
                format!("{tick}×"),
                (x(tick), bottom + 8),
                TextStyle::from(font(14)).pos(Pos::new(HPos::Center, VPos::Top)),
            ))
            .map_err(err)?;
        }
        tick += step;
    }
    root.draw(&PathElement::new(
        vec![(x(1.0), TOP - 10), (x(1.0), bottom)],
        BLACK.stroke_width(2),
    ))
    .map_err(err)?;
    root.draw(&Text::new(
        "direct = 1×; red tick: target; whisker: min–max of rounds",
        (x0, bottom + 32),
        font(14),
    ))
    .map_err(err)?;
    root.draw(&Text::new(
        format!(
            "at size: the config beside the bench's holds {}",
            AT_SIZE.words()
        ),
        (x0, bottom + 52),
        font(14),
    ))
    .map_err(err)?;
    for (i, bar) in bars.iter().enumerate() {
        let y = TOP + i as i32 * ROW;
        let mid = y + ROW / 2;
        root.draw(&Text::new(
            bar.label.clone(),
            (x0 - 8, mid),
            TextStyle::from(font(14)).pos(Pos::new(HPos::Right, VPos::Center)),
        ))
        .map_err(err)?;
        root.draw(&Rectangle::new(
            [(x0, y + 5), (x(bar.median), y + ROW - 5)],
            color(bar.route).filled(),
        ))
        .map_err(err)?;
        root.draw(&PathElement::new(
            vec![(x(bar.min), mid), (x(bar.max), mid)],
            BLACK.stroke_width(1),
        ))
        .map_err(err)?;
        for end in [bar.min, bar.max] {
            root.draw(&PathElement::new(
                vec![(x(end), mid - 5), (x(end), mid + 5)],
                BLACK,
            ))
            .map_err(err)?;
        }
        if let Some(t) = bar.target {
            root.draw(&PathElement::new(
                vec![(x(t), y + 1), (x(t), y + ROW - 1)],
                RED.stroke_width(3),
            ))
            .map_err(err)?;
        }
        let cut = if bar.max > scale_max { " ▸" } else { "" };
        root.draw(&Text::new(
            format!("{:.2}×{cut}", bar.median),
            (x(bar.max.max(bar.target.unwrap_or(0.0))) + 8, mid),
            TextStyle::from(font(14)).pos(Pos::new(HPos::Left, VPos::Center)),
        ))
        .map_err(err)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_a_png_with_every_bar() {
        let mut r = Results::new(2);
        for round in 0..2 {
            let k = round as f64;
            for (metric, base) in [
                (Metric::Throughput1, 20.0),
                (Metric::LatencyP50, 40.0),
                (Metric::ConnRate, 9000.0),
            ] {
                r.record(round, metric, Route::Direct, Some(base));
                r.record(round, metric, Route::Service, Some(base * (0.6 + k / 10.0)));
                r.record(round, metric, Route::Passthrough, Some(base * 1.7));
                r.record(round, metric, Route::FastServiceAtSize, Some(base));
            }
        }
        let higher = bars(
            &r,
            &[(
                Metric::Throughput1,
                &[Route::Service, Route::Passthrough][..],
            )],
        );
        assert_eq!(higher.len(), 2);
        assert_eq!(higher[0].target, Some(0.8));
        let at_size = bars(&r, &[(Metric::ConnRate, &[Route::FastServiceAtSize][..])]);
        assert_eq!(
            at_size[0].label,
            "new connections · service (fast path, at size)"
        );
        assert_eq!((at_size[0].median, at_size[0].target), (1.0, None));
        let dir = std::env::temp_dir().join(format!("xtask-chart-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let png = dir.join("chart.png");
        draw(&r, "test chart", &png).unwrap();
        let bytes = std::fs::read(&png).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(&bytes[1..4], b"PNG");
        assert!(
            bytes.len() > 10_000,
            "a chart with text is more than {} bytes",
            bytes.len()
        );
    }
}
