//! Helpers for end-to-end tests: a lab cluster in a temp dir driven through the real
//! `converge` CLI, and the real NBD clients (fio, nbdcopy, nbdinfo, qemu-img).

#![allow(clippy::unwrap_used)]
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

pub fn converge_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_converge"))
}

/// Run a command, returning its output; panics with stdout/stderr if it cannot start.
pub fn run(cmd: &mut Command) -> Output {
    let dbg = format!("{cmd:?}");
    cmd.output()
        .unwrap_or_else(|e| panic!("cannot run {dbg}: {e}"))
}

pub fn must(cmd: &mut Command) -> String {
    let dbg = format!("{cmd:?}");
    let o = run(cmd);
    assert!(
        o.status.success(),
        "{dbg} failed ({}):\nstdout:\n{}\nstderr:\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn require_tools() {
    for t in ["etcd", "fio", "nbdcopy", "nbdinfo", "qemu-img"] {
        let ok = Command::new("sh")
            .arg("-c")
            .arg(format!("command -v {t}"))
            .output()
            .map(|o| o.status.success())
            .unwrap_or(false);
        assert!(
            ok,
            "{t} is not installed: run scripts/setup.sh (tests need the real tools)"
        );
    }
}

pub struct Lab {
    pub dir: tempfile::TempDir,
}

impl Lab {
    pub fn up(nodes: u32, extra: &[&str]) -> Lab {
        require_tools();
        let dir = tempfile::Builder::new()
            .prefix("cvlab")
            .tempdir_in("/tmp")
            .expect("tempdir");
        let lab = Lab { dir };
        let n = nodes.to_string();
        let mut args = vec![
            "lab",
            "up",
            "--nodes",
            &n,
            "--drives-per-node",
            "2",
            "--drive-size",
            "1G",
            "--slab-size",
            "64M",
        ];
        args.extend_from_slice(extra);
        lab.must(&args);
        lab
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    pub fn cmd(&self, args: &[&str]) -> Command {
        let mut c = Command::new(converge_bin());
        c.args(args)
            .env("CONVERGE_LAB_DIR", self.path())
            .env_remove("CONVERGE_API");
        c
    }

    pub fn must(&self, args: &[&str]) -> String {
        must(&mut self.cmd(args))
    }

    /// Run expecting failure; returns stderr.
    pub fn fails(&self, args: &[&str]) -> String {
        let o = run(&mut self.cmd(args));
        assert!(
            !o.status.success(),
            "converge {args:?} should have failed but printed:\n{}",
            String::from_utf8_lossy(&o.stdout)
        );
        String::from_utf8_lossy(&o.stderr).into_owned()
    }

    pub fn json(&self, args: &[&str]) -> serde_json::Value {
        let mut a = args.to_vec();
        a.push("--json");
        let out = self.must(&a);
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("bad JSON from {args:?}: {e}\n{out}"))
    }

    pub fn create_volume(&self, name: &str, size: &str, resiliency: &str) -> String {
        self.must(&[
            "volume",
            "create",
            name,
            "--size",
            size,
            "--resiliency",
            resiliency,
        ]);
        self.uri(name)
    }

    pub fn uri(&self, name: &str) -> String {
        self.json(&["volume", "show", name])["uri"]
            .as_str()
            .expect("uri")
            .to_string()
    }

    /// kill -9 every node, then start each again with its data.
    pub fn kill_all_and_restart(&self, nodes: u32) {
        for n in 1..=nodes {
            self.must(&["lab", "fault", "kill", &n.to_string()]);
        }
        for n in 1..=nodes {
            self.must(&["lab", "fault", "restart", &n.to_string()]);
        }
    }

    pub fn lab_json(&self) -> serde_json::Value {
        let t = std::fs::read_to_string(self.path().join("lab.json")).expect("lab.json");
        serde_json::from_str(&t).expect("lab.json parses")
    }

    pub fn logs(&self) -> String {
        let mut s = String::new();
        for i in 1..=8 {
            let p = self.path().join(format!("node{i}/converged.log"));
            if let Ok(t) = std::fs::read_to_string(&p) {
                let lines: Vec<&str> = t.lines().collect();
                s.push_str(&format!(
                    "--- node{i} (last 30 lines)\n{}\n",
                    lines[lines.len().saturating_sub(30)..].join("\n")
                ));
            }
        }
        s
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        let _ = run(&mut self.cmd(&["lab", "down", "--purge"]));
    }
}

/// A file of `len` random bytes (seeded) in `dir`.
pub fn random_file(dir: &Path, name: &str, len: usize, seed: u64) -> PathBuf {
    use rand::{RngCore, SeedableRng};
    let mut r = rand::rngs::StdRng::seed_from_u64(seed);
    let mut v = vec![0u8; len];
    r.fill_bytes(&mut v);
    let p = dir.join(name);
    std::fs::write(&p, v).expect("write random file");
    p
}

/// fio against an NBD URI; returns fio's JSON output.
pub fn fio(uri: &str, args: &[&str]) -> serde_json::Value {
    let mut c = Command::new("fio");
    c.arg("--name=t")
        .arg("--ioengine=nbd")
        .arg(format!("--uri={uri}"))
        .arg("--output-format=json")
        .args(args);
    let out = must(&mut c);
    // fio may print warnings before the JSON.
    let start = out.find('{').expect("fio JSON output");
    serde_json::from_str(&out[start..]).expect("fio JSON parses")
}

pub fn fio_errors(v: &serde_json::Value) -> u64 {
    v["jobs"]
        .as_array()
        .expect("jobs")
        .iter()
        .map(|j| j["error"].as_u64().unwrap_or(0))
        .sum()
}
