//! The validation report: sections with measured figures and a verdict each, the criteria
//! that give the verdicts, and report.md / report.json.

use serde::Serialize;
use serde_json::Value;
use std::fmt::Write;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub enum Status {
    #[serde(rename = "PASS")]
    Pass,
    #[serde(rename = "SKIP")]
    Skip,
    #[serde(rename = "WARN")]
    Warn,
    #[serde(rename = "FAIL")]
    Fail,
}

impl Status {
    pub fn label(self) -> &'static str {
        match self {
            Status::Pass => "PASS",
            Status::Skip => "SKIP",
            Status::Warn => "WARN",
            Status::Fail => "FAIL",
        }
    }
}

/// One of the eight tests.
#[derive(Serialize)]
pub struct Section {
    pub number: u8,
    pub title: &'static str,
    /// How the verdict is reached, in words.
    pub criterion: String,
    pub status: Status,
    /// One or two sentences on what was found.
    pub finding: String,
    pub table: Table,
    /// The raw measurements, for report.json.
    pub figures: Value,
    pub seconds: f64,
}

impl Section {
    /// A section's verdict and figures; its number, title and time are filled in by the
    /// runner that times it.
    pub fn new(
        criterion: String,
        status: Status,
        finding: String,
        table: Table,
        figures: Value,
    ) -> Section {
        Section {
            number: 0,
            title: "",
            criterion,
            status,
            finding,
            table,
            figures,
            seconds: 0.0,
        }
    }

    /// A section that could not run: the error is its finding.
    pub fn failed(error: &anyhow::Error) -> Section {
        Section::new(
            String::new(),
            Status::Fail,
            format!("did not complete: {error:#}"),
            Table::default(),
            Value::Null,
        )
    }
}

#[derive(Default, Serialize)]
pub struct Table {
    pub header: Vec<String>,
    pub rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new(header: &[&str]) -> Table {
        Table {
            header: header.iter().map(|h| h.to_string()).collect(),
            rows: vec![],
        }
    }

    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    fn markdown(&self, out: &mut String) {
        if self.header.is_empty() {
            return;
        }
        let _ = writeln!(out, "| {} |", self.header.join(" | "));
        let _ = writeln!(out, "|{}", "---|".repeat(self.header.len()));
        for r in &self.rows {
            let _ = writeln!(out, "| {} |", r.join(" | "));
        }
        out.push('\n');
    }
}

/// Batching must raise decode throughput: PASS at ≥ 1.5× batch 1's at the largest batch,
/// WARN at ≥ 1×, FAIL below.
pub fn batch_scaling(decode_batch1: f64, decode_largest: f64) -> Status {
    let ratio = decode_largest / decode_batch1;
    if ratio >= 1.5 {
        Status::Pass
    } else if ratio >= 1.0 {
        Status::Warn
    } else {
        Status::Fail
    }
}

/// The first context whose decode rate is more than 20 % below the shortest context's.
pub fn knee(rates: &[(usize, f64)]) -> Option<usize> {
    let &(_, base) = rates.first()?;
    rates.iter().find(|r| r.1 < 0.8 * base).map(|r| r.0)
}

/// Resident memory after the warm-up against the end of the load (both taken idle), and
/// the KV blocks still held once every request has finished.
pub fn memory(warm_rss: u64, end_rss: u64, blocks_left: usize) -> (Status, f64) {
    let growth = end_rss as f64 / warm_rss as f64 - 1.0;
    let status = if blocks_left > 0 || growth > 0.05 {
        Status::Fail
    } else if growth > 0.02 {
        Status::Warn
    } else {
        Status::Pass
    };
    (status, growth)
}

/// Where two token sequences first differ, if they do.
pub fn first_difference(a: &[u32], b: &[u32]) -> Option<usize> {
    let common = a.iter().zip(b).take_while(|(x, y)| x == y).count();
    (common < a.len().max(b.len())).then_some(common)
}

/// Outputs that must be equal: PASS when all are, else FAIL where the backend promises
/// bit-identical results (the CPU) and WARN elsewhere.
pub fn equal_outputs(mismatches: usize, exact_backend: bool) -> Status {
    match (mismatches, exact_backend) {
        (0, _) => Status::Pass,
        (_, true) => Status::Fail,
        (_, false) => Status::Warn,
    }
}

/// The worst of the verdicts (FAIL over WARN over SKIP over PASS).
pub fn worst(statuses: impl IntoIterator<Item = Status>) -> Status {
    statuses.into_iter().max().unwrap_or(Status::Pass)
}

/// report.md: a summary table, then every section with its criterion, finding and figures.
pub fn markdown(header: &str, sections: &[Section], charts: &[(&str, &str)]) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "# ingot validation report\n\n{header}\n");
    let _ = writeln!(out, "| # | test | verdict | finding |\n|---|---|---|---|");
    for s in sections {
        let _ = writeln!(
            out,
            "| {} | {} | **{}** | {} |",
            s.number,
            s.title,
            s.status.label(),
            s.finding.replace('|', "\\|").replace('\n', " ")
        );
    }
    out.push('\n');
    for (title, file) in charts {
        let _ = writeln!(out, "- [{title}]({file})");
    }
    out.push('\n');
    for s in sections {
        let _ = writeln!(
            out,
            "## {}. {} — {} ({:.1} s)\n",
            s.number,
            s.title,
            s.status.label(),
            s.seconds
        );
        if !s.criterion.is_empty() {
            let _ = writeln!(out, "*Criterion:* {}\n", s.criterion);
        }
        let _ = writeln!(out, "{}\n", s.finding);
        s.table.markdown(&mut out);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batching_that_does_not_help_fails() {
        assert_eq!(batch_scaling(100.0, 400.0), Status::Pass);
        assert_eq!(batch_scaling(100.0, 120.0), Status::Warn);
        assert_eq!(batch_scaling(100.0, 90.0), Status::Fail);
    }

    #[test]
    fn knee_is_the_first_drop_beyond_a_fifth() {
        assert_eq!(knee(&[(512, 100.0), (1024, 90.0), (2048, 81.0)]), None);
        assert_eq!(
            knee(&[(512, 100.0), (1024, 85.0), (2048, 79.0), (4096, 50.0)]),
            Some(2048)
        );
        assert_eq!(knee(&[]), None);
    }

    #[test]
    fn memory_growth_or_leaked_blocks_fail() {
        assert_eq!(memory(1000, 1010, 0).0, Status::Pass);
        assert_eq!(memory(1000, 1030, 0).0, Status::Warn);
        assert_eq!(memory(1000, 1060, 0).0, Status::Fail);
        assert_eq!(memory(1000, 900, 3).0, Status::Fail);
        assert!((memory(1000, 1010, 0).1 - 0.01).abs() < 1e-12);
    }

    #[test]
    fn differing_outputs_are_found_and_fail_on_exact_backends() {
        assert_eq!(first_difference(&[1, 2, 3], &[1, 2, 3]), None);
        assert_eq!(first_difference(&[1, 2, 3], &[1, 5, 3]), Some(1));
        assert_eq!(first_difference(&[1, 2], &[1, 2, 3]), Some(2));
        assert_eq!(equal_outputs(0, true), Status::Pass);
        assert_eq!(equal_outputs(1, true), Status::Fail);
        assert_eq!(equal_outputs(1, false), Status::Warn);
    }

    #[test]
    fn the_worst_verdict_wins_and_reaches_the_report() {
        assert_eq!(
            worst([Status::Pass, Status::Warn, Status::Skip]),
            Status::Warn
        );
        assert_eq!(
            worst([Status::Pass, Status::Fail, Status::Warn]),
            Status::Fail
        );
        let s = Section {
            number: 5,
            title: "batch edge cases",
            criterion: "outputs equal".into(),
            status: Status::Fail,
            finding: "1 of 3 differ".into(),
            table: Table {
                header: vec!["batch".into(), "differ".into()],
                rows: vec![vec!["3".into(), "1".into()]],
            },
            figures: Value::Null,
            seconds: 1.0,
        };
        let md = markdown("machine", &[s], &[("chart", "charts/x.svg")]);
        assert!(md.contains("| 5 | batch edge cases | **FAIL** | 1 of 3 differ |"));
        assert!(md.contains("## 5. batch edge cases — FAIL"));
        assert!(md.contains("| 3 | 1 |"));
        assert!(md.contains("[chart](charts/x.svg)"));
    }
}
