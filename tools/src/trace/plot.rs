//! A small SVG plot of live vs reserved bytes over a replay (no plotting
//! dependency: one polyline per series).

use std::fmt::Write;

/// One series: a name, a colour, and (x, y) points.
#[derive(Debug, Clone)]
pub struct Series<'a> {
    /// Legend text.
    pub name: &'a str,
    /// SVG colour.
    pub colour: &'a str,
    /// Points in data units.
    pub points: Vec<(f64, f64)>,
}

/// Renders series as an SVG line chart with axes and a legend. `y_unit`
/// divides y values for the axis labels (e.g. 2^30 for GiB).
pub fn line_chart(
    title: &str,
    x_label: &str,
    y_label: &str,
    y_unit: f64,
    series: &[Series<'_>],
) -> String {
    let (w, h, left, right, top, bottom) = (900.0, 420.0, 80.0, 20.0, 40.0, 50.0);
    let pts = series.iter().flat_map(|s| s.points.iter());
    let x_max = pts.clone().map(|p| p.0).fold(1e-9, f64::max);
    let y_max = pts.map(|p| p.1).fold(1e-9, f64::max) * 1.05;
    let sx = |x: f64| left + x / x_max * (w - left - right);
    let sy = |y: f64| h - bottom - y / y_max * (h - top - bottom);
    let mut svg = String::new();
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(svg, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        svg,
        r#"<text x="{}" y="22" font-size="15" text-anchor="middle">{}</text>"#,
        w / 2.0,
        escape(title)
    );
    for i in 0..=5 {
        let y = y_max * i as f64 / 5.0;
        let _ = writeln!(
            svg,
            r##"<line x1="{left}" x2="{}" y1="{y0}" y2="{y0}" stroke="#ddd"/><text x="{}" y="{}" text-anchor="end">{:.2}</text>"##,
            w - right,
            left - 6.0,
            sy(y) + 4.0,
            y / y_unit,
            y0 = sy(y)
        );
    }
    let _ = writeln!(
        svg,
        r#"<line x1="{left}" x2="{left}" y1="{top}" y2="{}" stroke="black"/>"#,
        h - bottom
    );
    let _ = writeln!(
        svg,
        r#"<line x1="{left}" x2="{}" y1="{y}" y2="{y}" stroke="black"/>"#,
        w - right,
        y = h - bottom
    );
    let _ = writeln!(
        svg,
        r#"<text x="{}" y="{}" text-anchor="middle">{}</text>"#,
        w / 2.0,
        h - 12.0,
        escape(x_label)
    );
    for i in 0..=4 {
        let x = x_max * i as f64 / 4.0;
        let _ = writeln!(
            svg,
            r#"<text x="{}" y="{}" text-anchor="middle">{:.0}</text>"#,
            sx(x),
            h - bottom + 16.0,
            x
        );
    }
    let _ = writeln!(
        svg,
        r#"<text x="20" y="{}" text-anchor="middle" transform="rotate(-90 20 {})">{}</text>"#,
        h / 2.0,
        h / 2.0,
        escape(y_label)
    );
    for (k, s) in series.iter().enumerate() {
        let mut d = String::new();
        for (x, y) in &s.points {
            let _ = write!(d, "{:.1},{:.1} ", sx(*x), sy(*y));
        }
        let _ = writeln!(
            svg,
            r#"<polyline fill="none" stroke="{}" stroke-width="1.5" points="{}"/>"#,
            s.colour,
            d.trim_end()
        );
        // Legend in the lower right corner, where the curves rarely are.
        let (lx, ly) = (
            w - right - 230.0,
            h - bottom - 14.0 - 16.0 * (series.len() - 1 - k) as f64,
        );
        let _ = writeln!(
            svg,
            r#"<rect x="{}" y="{}" width="226" height="16" fill="white" opacity="0.8"/><line x1="{}" x2="{}" y1="{ly}" y2="{ly}" stroke="{}" stroke-width="3"/><text x="{}" y="{}">{}</text>"#,
            lx - 4.0,
            ly - 9.0,
            lx,
            lx + 20.0,
            s.colour,
            lx + 26.0,
            ly + 4.0,
            escape(s.name)
        );
    }
    svg.push_str("</svg>\n");
    svg
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chart_has_one_polyline_per_series_and_escapes_text() {
        let s = [
            Series {
                name: "live",
                colour: "blue",
                points: vec![(0.0, 1.0), (1.0, 2.0)],
            },
            Series {
                name: "reserved <pool>",
                colour: "red",
                points: vec![(0.0, 2.0), (1.0, 3.0)],
            },
        ];
        let svg = line_chart("t & t", "x", "GiB", 1.0, &s);
        assert_eq!(svg.matches("<polyline").count(), 2);
        assert!(svg.contains("t &amp; t") && svg.contains("&lt;pool&gt;"));
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    }
}
