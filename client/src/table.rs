//! Plain-text tables and names for the CLI and the demo.

use fairplace_proto::v1 as pb;
use fairplace_types::quote::printable;

/// A proposal's migration type as the kernel names it.
pub fn migration_type_name(t: i32) -> &'static str {
    match pb::MigrationType::try_from(t) {
        Ok(pb::MigrationType::Load) => "load",
        Ok(pb::MigrationType::Util) => "util",
        Ok(pb::MigrationType::Task) => "task",
        Ok(pb::MigrationType::Misfit) => "misfit",
        Ok(pb::MigrationType::LlcTask) => "llc_task",
        Err(_) => "?",
    }
}

/// Formats rows under a header, each column as wide as its widest cell.
pub fn render(header: &[&str], rows: &[Vec<String>]) -> String {
    // A cell is what a node or a caller sent: never raw control characters
    // on the terminal (a newline would forge a row, an escape sequence
    // would reach the terminal).
    let rows: Vec<Vec<String>> = rows
        .iter()
        .map(|r| r.iter().map(|c| printable(c).into_owned()).collect())
        .collect();
    let rows = &rows;
    let mut width: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            if i < width.len() {
                width[i] = width[i].max(c.chars().count());
            }
        }
    }
    let line = |cells: Vec<&str>| {
        let mut s = String::new();
        for (i, c) in cells.iter().enumerate() {
            if i > 0 {
                s.push_str("  ");
            }
            s.push_str(c);
            if i + 1 < cells.len() {
                s.push_str(&" ".repeat(width[i].saturating_sub(c.chars().count())));
            }
        }
        s.push('\n');
        s
    };
    let mut out = line(header.to_vec());
    out.push_str(&line(
        width
            .iter()
            .map(|w| "-".repeat(*w))
            .collect::<Vec<_>>()
            .iter()
            .map(|s| s.as_str())
            .collect(),
    ));
    // Every row as wide as the header: extra cells are dropped, missing
    // ones left blank.
    for r in rows {
        out.push_str(&line(
            (0..header.len())
                .map(|i| r.get(i).map_or("", |s| s.as_str()))
                .collect(),
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn columns_align_to_the_widest_cell() {
        let t = super::render(
            &["cpu", "path"],
            &[
                vec!["12".into(), "idle_core".into()],
                vec!["3".into(), "target".into()],
            ],
        );
        assert_eq!(
            t,
            "cpu  path\n---  ---------\n12   idle_core\n3    target\n"
        );
    }

    #[test]
    fn a_cell_cannot_forge_a_row_or_reach_the_terminal() {
        let t = super::render(
            &["node", "zone"],
            &[vec!["n1".into(), "eu\nn2      eu-2\u{1b}[2J".into()]],
        );
        assert_eq!(t.lines().count(), 3, "{t}");
        assert!(!t.contains('\u{1b}'), "{t:?}");
        assert!(t.contains("eu\\nn2"), "{t}");
    }
}
