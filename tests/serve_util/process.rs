//! `tandem serve` as a child process: started with `--port 0 --http-port 0`, its stderr read
//! line by line, signalled and waited for.

use super::Client;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{channel, Receiver};
use std::time::Duration;

/// How long a test waits for a line the server must print.
const WAIT: Duration = Duration::from_secs(120);

pub struct Served {
    pub child: Child,
    pub lines: Receiver<String>,
    pub addr: SocketAddr,
    /// Everything printed so far.
    pub log: Vec<String>,
}

impl Served {
    /// Starts `tandem serve ARGS --port 0` and waits until it says SERVING.
    pub fn start(args: &[&str]) -> Served {
        Served::start_with_env(args, &[])
    }

    /// [`Served::start`] with extra environment variables.
    pub fn start_with_env(args: &[&str], env: &[(&str, &str)]) -> Served {
        let mut child = Command::new(env!("CARGO_BIN_EXE_tandem"))
            .envs(env.iter().copied())
            .arg("serve")
            .args(args)
            .args(["--host", "127.0.0.1", "--port", "0", "--http-port", "0"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("starting tandem serve");
        let stderr = child.stderr.take().unwrap();
        let (tx, lines) = channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut s = Served { child, lines, addr: "127.0.0.1:0".parse().unwrap(), log: Vec::new() };
        let on = s.wait_for("gRPC on ");
        s.addr = on.split("gRPC on ").nth(1).and_then(|r| r.split(' ').next()).unwrap().parse().unwrap();
        s.wait_for("SERVING");
        s
    }

    pub fn wait_for(&mut self, what: &str) -> String {
        loop {
            match self.lines.recv_timeout(WAIT) {
                Ok(l) => {
                    self.log.push(l.clone());
                    if l.contains(what) {
                        return l;
                    }
                }
                Err(_) => panic!("tandem serve never printed {what:?}:\n{}", self.log.join("\n")),
            }
        }
    }

    pub async fn client(&self) -> Client {
        Client::connect(format!("http://{}", self.addr)).await.unwrap()
    }

    pub fn signal(&self, sig: i32) {
        // SAFETY: kill(2) with the pid of a child this test started and still owns.
        assert_eq!(unsafe { libc::kill(self.child.id() as i32, sig) }, 0);
    }

    /// Waits for the process to exit; returns its exit code.
    pub fn exit_code(mut self) -> i32 {
        let status = self.child.wait().unwrap();
        for l in self.lines.try_iter() {
            self.log.push(l);
        }
        let log = self.log.join("\n");
        assert!(!log.contains("panicked"), "{log}");
        status.code().unwrap_or_else(|| panic!("killed by a signal: {status:?}\n{log}"))
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
    }
}
