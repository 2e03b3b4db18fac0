//! The replay's report for people (lines and a table per setting, an SVG
//! chart) and for machines (JSON).

use std::fmt::Write as _;

use super::Report;
use super::judge::{Outcomes, SettingStats};

/// The report as text: the summary lines, each setting's line, then each
/// setting's table. `show` answers not reproduced are listed whole.
pub fn text(r: &Report, show: usize) -> String {
    let mut o = String::new();
    let _ = writeln!(
        o,
        "replay: {} segments, {} entries, {} nodes",
        r.segments, r.entries, r.nodes
    );
    for d in &r.damaged {
        let _ = writeln!(
            o,
            "replay: damaged: {d}; the rest of that segment is skipped"
        );
    }
    let _ = writeln!(
        o,
        "replay: {}/{} answers reproduced",
        r.reproduced, r.decisions
    );
    for m in r.mismatches.iter().take(show) {
        let _ = writeln!(
            o,
            "replay: not reproduced: node {} version {} {}: recorded {}, replayed {}; request {}",
            m.node, m.version, m.kind, m.recorded, m.replayed, m.request
        );
    }
    if r.no_state > 0 {
        let _ = writeln!(
            o,
            "replay: {} decisions read a state the recording does not hold ({} events dropped while recording)",
            r.no_state, r.dropped
        );
    }
    if r.bad_states > 0 {
        let _ = writeln!(
            o,
            "replay: {} states not rebuilt: {}",
            r.bad_states,
            r.bad_state_reasons.join("; ")
        );
    }
    if r.balances > 0 {
        let _ = writeln!(
            o,
            "replay: {} balance passes recorded, not decided again (a pass reads its balancer's kept state)",
            r.balances
        );
    }
    for s in &r.settings {
        let _ = writeln!(o, "{}", s.line());
    }
    for s in &r.settings {
        table(&mut o, s);
    }
    o
}

fn table(o: &mut String, s: &SettingStats) {
    let _ = writeln!(o, "\n{}", s.setting);
    let _ = writeln!(
        o,
        "  {:<40} {:>10} {:>8} {:>7} {:>11}",
        "kind, recorded path", "decisions", "changed", "share", "other path"
    );
    let rows = s
        .by_path
        .iter()
        .map(|(k, c)| (k.as_str(), c.decisions, c.changed, c.path_changed));
    for (k, n, changed, path) in rows.chain([("all", s.decisions, s.changed, s.path_changed)]) {
        let _ = writeln!(
            o,
            "  {:<40} {:>10} {:>8} {:>6.1}% {:>11}",
            k,
            n,
            changed,
            share(changed, n),
            path
        );
    }
    let _ = writeln!(
        o,
        "  CPUs scanned: mean {:.2} -> {:.2}, p99 {} -> {}",
        s.scanned_mean_before, s.scanned_mean_after, s.scanned_p99_before, s.scanned_p99_after
    );
    let _ = writeln!(
        o,
        "  at the next report ({} placements judged): {}",
        s.before.judged,
        outcomes(&s.before, &s.after)
    );
}

fn outcomes(a: &Outcomes, b: &Outcomes) -> String {
    let pair = |x: u64, y: u64| format!("{:.1} % -> {:.1} %", a.pct(x), b.pct(y));
    format!(
        "idle {}, busy SMT sibling {}, LLC crossed from prev_cpu {}, SCHED_IDLE-only {}",
        pair(a.idle, b.idle),
        pair(a.busy_sibling, b.busy_sibling),
        pair(a.cross_llc, b.cross_llc),
        pair(a.sched_idle_only, b.sched_idle_only)
    )
}

fn share(n: u64, of: u64) -> f64 {
    if of == 0 {
        0.0
    } else {
        100.0 * n as f64 / of as f64
    }
}

/// The report as one JSON document.
pub fn json(r: &Report) -> String {
    serde_json::to_string_pretty(r).unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"))
}

/// Each setting as a row of bars: the share of decisions it changed, and
/// the four next-report measures before and after, in percent.
pub fn svg(r: &Report) -> String {
    const W: f64 = 960.0;
    const LABEL: f64 = 300.0;
    const ROW: f64 = 120.0;
    let bars: [(&str, &str); 5] = [
        ("decisions changed", "#4e79a7"),
        ("next report: idle", "#59a14f"),
        ("busy SMT sibling", "#e15759"),
        ("LLC crossed", "#f28e2b"),
        ("SCHED_IDLE-only", "#b07aa1"),
    ];
    let h = 70.0 + ROW * r.settings.len().max(1) as f64;
    let mut o = String::new();
    let _ = writeln!(
        o,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{h}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(o, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        o,
        r#"<text x="10" y="20" font-size="15">fairplace replay: {}/{} answers reproduced; per switch, % of decisions (bars: recorded features light, switched dark)</text>"#,
        r.reproduced, r.decisions
    );
    for (k, (name, color)) in bars.iter().enumerate() {
        let x = 10.0 + k as f64 * 185.0;
        let _ = writeln!(
            o,
            r#"<rect x="{x}" y="32" width="12" height="12" fill="{color}"/><text x="{}" y="43">{name}</text>"#,
            x + 16.0
        );
    }
    let scale = (W - LABEL - 70.0) / 100.0;
    for (i, s) in r.settings.iter().enumerate() {
        let y0 = 60.0 + ROW * i as f64;
        let _ = writeln!(
            o,
            r#"<text x="10" y="{}">{}</text>"#,
            y0 + ROW / 2.0,
            escape(&s.setting)
        );
        let values = [
            (None, share(s.changed, s.decisions)),
            (Some(s.before.pct(s.before.idle)), s.after.pct(s.after.idle)),
            (
                Some(s.before.pct(s.before.busy_sibling)),
                s.after.pct(s.after.busy_sibling),
            ),
            (
                Some(s.before.pct(s.before.cross_llc)),
                s.after.pct(s.after.cross_llc),
            ),
            (
                Some(s.before.pct(s.before.sched_idle_only)),
                s.after.pct(s.after.sched_idle_only),
            ),
        ];
        for (k, (before, after)) in values.iter().enumerate() {
            let y = y0 + 6.0 + k as f64 * 21.0;
            let color = bars[k].1;
            if let Some(b) = before {
                let _ = writeln!(
                    o,
                    r#"<rect x="{LABEL}" y="{y}" width="{:.1}" height="8" fill="{color}" fill-opacity="0.4"/>"#,
                    b * scale
                );
            }
            let _ = writeln!(
                o,
                r#"<rect x="{LABEL}" y="{}" width="{:.1}" height="8" fill="{color}"/><text x="{:.1}" y="{}">{}{:.1} %</text>"#,
                y + 9.0,
                after * scale,
                LABEL + after * scale + 4.0,
                y + 16.0,
                before.map_or(String::new(), |b| format!("{b:.1} % -> ")),
                after
            );
        }
    }
    o.push_str("</svg>\n");
    o
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}
