//! `fenced` under valgrind's callgrind, for instruction counts of exactly the calls a loop
//! made: the server's counters are zeroed before the loop and dumped after it with
//! `callgrind_control`. Instructions, unlike time or CPU, barely move with what else the
//! machine is doing, so two builds can be compared on one noisy machine.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, Result, ensure};

/// A `fenced` process running under callgrind.
#[derive(Debug)]
pub struct Callgrind {
    /// What the dumps' paths start with: callgrind writes `<out>.<pid>.<n>`.
    out: PathBuf,
    pid: u32,
    dumps: u32,
}

impl Callgrind {
    /// The program and arguments to run `fenced` under (see `Fenced::start`), its
    /// dumps written to paths starting with `out`.
    pub fn prefix(out: &Path) -> Vec<String> {
        vec![
            "valgrind".into(),
            "--tool=callgrind".into(),
            format!("--callgrind-out-file={}.%p", out.display()),
        ]
    }

    /// The server started with [`Callgrind::prefix`]`(out)`, as process `pid`.
    pub fn attach(out: &Path, pid: u32) -> Self {
        Self {
            out: out.to_path_buf(),
            pid,
            dumps: 0,
        }
    }

    /// The paths of the dumps so far, as a shell pattern.
    pub fn dumps(&self) -> String {
        format!(
            "{}.{}.* ({} dumps)",
            self.out.display(),
            self.pid,
            self.dumps
        )
    }

    /// Zeroes the server's counters: what it executes next is counted from nothing.
    pub async fn zero(&self) -> Result<()> {
        control("-z", self.pid).await
    }

    /// Dumps the counters (to the next of [`Callgrind::dumps`], for `callgrind_annotate`)
    /// and returns the instructions executed since the last [`Callgrind::zero`].
    pub async fn dump(&mut self) -> Result<u64> {
        control("-d", self.pid).await?;
        self.dumps += 1;
        let path = PathBuf::from(format!(
            "{}.{}.{}",
            self.out.display(),
            self.pid,
            self.dumps
        ));
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("read the callgrind dump {}", path.display()))?;
        summary(&text).with_context(|| format!("no instruction summary in {}", path.display()))
    }
}

/// Runs `callgrind_control <op> <pid>`, which returns once the process carried it out. What
/// it prints is kept out of the tables, and shown only when it fails.
async fn control(op: &'static str, pid: u32) -> Result<()> {
    let out = tokio::task::spawn_blocking(move || {
        Command::new("callgrind_control")
            .arg(op)
            .arg(pid.to_string())
            .stdin(Stdio::null())
            .output()
    })
    .await?
    .context("run callgrind_control (valgrind's)")?;
    ensure!(
        out.status.success(),
        "callgrind_control {op} {pid}: {}: {}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

/// The instructions (`Ir`) a callgrind dump counted: its `summary:` line.
fn summary(dump: &str) -> Option<u64> {
    dump.lines()
        .find_map(|l| l.strip_prefix("summary:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dumps_summary_line_holds_its_instructions() {
        let dump = "version: 1\ncreator: callgrind-3.19.0\nevents: Ir\nsummary: 520317650\n\
                    fn=(1) main\n3 12\ntotals: 520535145\n";
        assert_eq!(summary(dump), Some(520_317_650));
        assert_eq!(summary("events: Ir\ntotals: 5\n"), None);
        assert_eq!(summary("summary: many\n"), None);
    }

    #[test]
    fn fenced_runs_under_valgrind_with_numbered_dumps() {
        let out = Path::new("/tmp/w/callgrind.fenced");
        assert_eq!(
            Callgrind::prefix(out),
            [
                "valgrind",
                "--tool=callgrind",
                "--callgrind-out-file=/tmp/w/callgrind.fenced.%p"
            ]
        );
    }
}
