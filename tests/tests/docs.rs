//! The metric table (docs/metrics.md) lists every metric the server
//! exports, with its type.

#[test]
fn the_metrics_doc_documents_every_metric() {
    let readme = include_str!("../../docs/metrics.md");
    for (name, kind, _) in fairplace::metrics::ALL {
        let row = readme
            .lines()
            .find(|l| l.starts_with(&format!("| `{name}` |")))
            .unwrap_or_else(|| panic!("docs/metrics.md has no row for {name}"));
        assert!(
            row.contains(&format!("| {kind} |")),
            "{name} is a {kind}: {row}"
        );
    }
}
