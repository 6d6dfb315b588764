//! The real `fenced` binary as a child process on an ephemeral port (killed when dropped), for
//! the tests that need a separate process: its memory, its exit, its disk.

use std::io::{BufRead, BufReader, Lines};
use std::path::Path;
use std::process::{Child, ChildStdout, Command, Stdio};

/// A running `fenced`.
pub struct Fenced {
    pub child: Child,
    /// `127.0.0.1:PORT` of the gRPC listener.
    pub addr: String,
    stdout: Option<Lines<BufReader<ChildStdout>>>,
}

impl Fenced {
    /// Starts `fenced --listen 127.0.0.1:0 --data-dir DATA ARGS...` and reads its address line.
    pub fn start(data: &Path, args: &[&str]) -> Fenced {
        Fenced::start_with_env(data, args, &[])
    }

    /// [`Fenced::start`] with extra environment variables.
    pub fn start_with_env(data: &Path, args: &[&str], env: &[(&str, &str)]) -> Fenced {
        let mut child = Command::new(env!("CARGO_BIN_EXE_fenced"))
            .args(["--listen", "127.0.0.1:0", "--data-dir"])
            .arg(data)
            .args(args)
            .env("RUST_LOG", "error")
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut stdout = BufReader::new(child.stdout.take().unwrap()).lines();
        let addr = next_line(&mut stdout, "fenced listening on ");
        Fenced {
            child,
            addr,
            stdout: Some(stdout),
        }
    }

    /// `http://ADDR` of the gRPC listener.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The metrics listener's address (the second stdout line, with `--metrics-listen`).
    pub fn metrics_addr(&mut self) -> String {
        next_line(
            self.stdout.as_mut().expect("stdout is open"),
            "fenced metrics on ",
        )
    }

    /// Asks it to stop (SIGTERM) and waits until it has: it drains and flushes first.
    pub fn terminate(&mut self) -> std::process::ExitStatus {
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success(), "kill -TERM failed");
        self.child.wait().unwrap()
    }

    /// Sends SIGTERM and waits up to `limit` for it to exit: `None` if it is still running.
    pub fn terminate_within(
        &mut self,
        limit: std::time::Duration,
    ) -> Option<std::process::ExitStatus> {
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success(), "kill -TERM failed");
        let deadline = std::time::Instant::now() + limit;
        while std::time::Instant::now() < deadline {
            if let Some(status) = self.child.try_wait().unwrap() {
                return Some(status);
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        None
    }

    /// Closes our end of its stdout, as a launcher that read only the address line does.
    pub fn close_stdout(&mut self) {
        self.stdout = None;
    }
}

fn next_line(lines: &mut Lines<BufReader<ChildStdout>>, prefix: &str) -> String {
    let line = lines.next().expect("a line from fenced").unwrap();
    line.trim()
        .strip_prefix(prefix)
        .unwrap_or_else(|| panic!("expected {prefix:?}, fenced printed {line:?}"))
        .to_owned()
}

impl Drop for Fenced {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
