//! The README's metric table lists every metric the server exports, with
//! its type.

#[test]
fn the_readme_documents_every_metric() {
    let readme = include_str!("../../README.md");
    for (name, kind, _) in fairplace::metrics::ALL {
        let row = readme
            .lines()
            .find(|l| l.starts_with(&format!("| `{name}` |")))
            .unwrap_or_else(|| panic!("README has no row for {name}"));
        assert!(
            row.contains(&format!("| {kind} |")),
            "{name} is a {kind}: {row}"
        );
    }
}
