//! `converge cluster rolling-restart`: restart (or upgrade) the nodes one at a time, each
//! only once the cluster is whole again.
//!
//! Per node: wait until the cluster is healthy (every node live, every copy in sync, no
//! repair running); put the node in maintenance (its volumes move to other owners, its
//! copies stop being written); restart it (a command of the operator's, e.g. `ssh HOST
//! systemctl restart converged`, or the lab's own restart); wait until it is live again;
//! end its maintenance (it resyncs what it missed); wait until the cluster is healthy again.
//! A client attached to another node's export sees no error; one attached to the node
//! being restarted loses its connection and must reconnect elsewhere (qemu's
//! `reconnect-delay`, or attach through a node that is not restarted).

use crate::http;
use anyhow::{anyhow, bail, Context, Result};
use converge_api::{Maintenance, NodeInfo, Status};
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// How one node is restarted.
pub enum Restart {
    /// `sh -c TEMPLATE` where `{id}`, `{name}` and `{host}` (the host of the node's API
    /// address) stand for the node's values, passed to the shell as arguments (`"$1"`,
    /// `"$2"`, `"$3"`), never spliced into the command: a name in etcd is data, not shell.
    Exec(String),
    /// The lab in this directory stops the node's process and starts it again.
    Lab(PathBuf),
}

/// What happened to one node.
#[derive(serde::Serialize)]
pub struct Step {
    pub node: u32,
    pub version_before: String,
    pub version_after: String,
    /// Seconds from the start of its maintenance until the cluster was healthy again.
    pub seconds: f64,
}

const POLL: Duration = Duration::from_millis(250);

fn status(base: &str) -> Result<Status> {
    http::call(base, "GET", "/v1/status", None)
}

/// Waits until the cluster reports healthy, up to `timeout`; `why` says what for.
fn wait_healthy(base: &str, timeout: Duration, why: &str) -> Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        let last = match status(base) {
            Ok(s) if s.redundant() && s.nodes.iter().all(|n| !n.maintenance) => return Ok(()),
            Ok(s) => s.health,
            Err(e) => format!("{e:#}"),
        };
        if Instant::now() > deadline {
            bail!(
                "the cluster was not healthy {why} within {} s (last: {last}); nothing more \
                 was restarted",
                timeout.as_secs()
            );
        }
        std::thread::sleep(POLL);
    }
}

fn node_info(base: &str, id: u32) -> Result<NodeInfo> {
    let nodes: Vec<NodeInfo> = http::call(base, "GET", "/v1/nodes", None)?;
    nodes
        .into_iter()
        .find(|n| n.id.0 == id)
        .ok_or_else(|| anyhow!("the cluster has no node {id}"))
}

fn maintenance(base: &str, id: u32, on: bool, timeout: Duration) -> Result<()> {
    let body = serde_json::to_value(Maintenance { on })?;
    let deadline = Instant::now() + timeout;
    loop {
        let r = http::call::<Vec<NodeInfo>>(
            base,
            "POST",
            &format!("/v1/nodes/{id}/maintenance"),
            Some(&body),
        );
        match r {
            Ok(_) => return Ok(()),
            // Ending maintenance may have to wait for the node to be reachable again.
            Err(e) if !on && Instant::now() < deadline => {
                log_line(&format!(
                    "node {id}: maintenance off not yet possible: {e:#}"
                ));
                std::thread::sleep(Duration::from_secs(1));
            }
            Err(e) => {
                return Err(e.context(format!(
                    "node {id}: maintenance {}",
                    if on { "on" } else { "off" }
                )))
            }
        }
    }
}

fn log_line(s: &str) {
    eprintln!("{s}");
}

fn restart(how: &Restart, info: &NodeInfo) -> Result<()> {
    match how {
        Restart::Exec(template) => {
            let mut cmd = exec_command(template, info)?;
            let shown = format!("{cmd:?}");
            log_line(&format!("node {}: running {shown}", info.id));
            let st = cmd.status().with_context(|| format!("running {shown}"))?;
            if !st.success() {
                bail!("node {}: `{shown}` failed ({st}); stopping here", info.id);
            }
            Ok(())
        }
        Restart::Lab(dir) => {
            let mut l = crate::lab::load(dir)?;
            let n = l
                .nodes
                .iter()
                .find(|n| n.id == info.id.0)
                .ok_or_else(|| anyhow!("the lab has no node {}", info.id))?;
            crate::lab::stop_proc(&n.proc, Duration::from_secs(60));
            crate::lab::restart_node(&mut l, info.id.0)
        }
    }
}

/// The host of a node's API address (`HOST:PORT`, `[V6]:PORT`, with or without https://).
fn host_of(api_addr: &str) -> &str {
    api_addr
        .trim_start_matches("https://")
        .rsplit_once(':')
        .map_or(api_addr, |(h, _)| h)
        .trim_start_matches('[')
        .trim_end_matches(']')
}

/// `sh -c TEMPLATE sh ID NAME HOST`, with `{id}`, `{name}` and `{host}` in the template
/// turned into `"$1"`, `"$2"` and `"$3"`: whatever the values hold, the shell sees them as
/// words, never as commands. Values that are no node name or host name at all (a record
/// written by hand into etcd, say) are refused before anything runs.
fn exec_command(template: &str, info: &NodeInfo) -> Result<std::process::Command> {
    let host = host_of(&info.api_addr);
    if !converge_types::valid_node_name(&info.name) {
        bail!(
            "node {}: its name {:?} in etcd is not a node name (letters, digits, '.', '_', \
             '-'): refusing to run --exec for it",
            info.id,
            info.name
        );
    }
    if host.is_empty()
        || !host
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b':'))
    {
        bail!(
            "node {}: the host {host:?} of its API address in etcd is not an address or host \
             name: refusing to run --exec for it",
            info.id
        );
    }
    let script = template
        .replace("{id}", "\"$1\"")
        .replace("{name}", "\"$2\"")
        .replace("{host}", "\"$3\"");
    let mut cmd = std::process::Command::new("sh");
    cmd.arg("-c")
        .arg(script)
        .arg("sh")
        .arg(info.id.0.to_string())
        .arg(&info.name)
        .arg(host);
    Ok(cmd)
}

/// Restarts `nodes` (all, in id order, if empty) one at a time; see the module doc.
pub fn run(base: &str, how: &Restart, nodes: &[u32], timeout: Duration) -> Result<Vec<Step>> {
    let all: Vec<NodeInfo> = http::call(base, "GET", "/v1/nodes", None)?;
    let mut order: Vec<u32> = if nodes.is_empty() {
        all.iter().map(|n| n.id.0).collect()
    } else {
        for id in nodes {
            if !all.iter().any(|n| n.id.0 == *id) {
                bail!("the cluster has no node {id}");
            }
        }
        nodes.to_vec()
    };
    order.sort_unstable();
    order.dedup();
    let mut steps = Vec::new();
    for id in order {
        wait_healthy(base, timeout, &format!("before node {id}"))?;
        let before = node_info(base, id)?;
        let t0 = Instant::now();
        log_line(&format!(
            "node {id}: maintenance on (its volumes move to other owners)"
        ));
        maintenance(base, id, true, timeout)?;
        restart(how, &before)?;
        // Live again: registered with a new lease by the restarted process.
        let deadline = Instant::now() + timeout;
        loop {
            if node_info(base, id).is_ok_and(|n| n.live) {
                break;
            }
            if Instant::now() > deadline {
                bail!(
                    "node {id} did not come back within {} s; it stays in maintenance (end it \
                     with `converge node maintenance {id} off` once it is up)",
                    timeout.as_secs()
                );
            }
            std::thread::sleep(POLL);
        }
        log_line(&format!("node {id}: live again; maintenance off (resync)"));
        maintenance(base, id, false, timeout)?;
        wait_healthy(base, timeout, &format!("after node {id}"))?;
        let after = node_info(base, id)?;
        let step = Step {
            node: id,
            version_before: before.version,
            version_after: after.version,
            seconds: t0.elapsed().as_secs_f64(),
        };
        log_line(&format!(
            "node {id}: done in {:.1} s, every copy in sync (version {} -> {})",
            step.seconds, step.version_before, step.version_after
        ));
        steps.push(step);
    }
    Ok(steps)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(name: &str, api: &str) -> NodeInfo {
        NodeInfo {
            name: name.to_string(),
            api_addr: api.to_string(),
            live: true,
            ..NodeInfo::down(converge_types::NodeId(2))
        }
    }

    fn output(template: &str, i: &NodeInfo) -> String {
        let out = exec_command(template, i).unwrap().output().unwrap();
        assert!(out.status.success(), "{out:?}");
        String::from_utf8(out.stdout).unwrap()
    }

    /// The values come from etcd, which anyone holding a node's etcd credentials writes:
    /// they reach the command as words, never as shell (before, a node named
    /// `x;touch /tmp/owned` ran that command on the operator's machine).
    #[test]
    fn exec_values_are_arguments_not_shell() {
        let ok = info("node-2.rack1", "10.0.0.2:7200");
        assert_eq!(
            output("echo {id} {name} {host}", &ok),
            "2 node-2.rack1 10.0.0.2\n"
        );
        let v6 = info("n2", "https://[fd00::2]:7200");
        assert_eq!(output("echo ssh root@{host}", &v6), "ssh root@fd00::2\n");
        let dir = tempfile::tempdir().unwrap();
        let marker = dir.path().join("owned");
        for (name, api) in [
            (
                format!("x;touch {}", marker.display()),
                "10.0.0.2:7200".to_string(),
            ),
            ("$(id)".to_string(), "10.0.0.2:7200".to_string()),
            (
                "n2".to_string(),
                format!("`touch {}`:7200", marker.display()),
            ),
        ] {
            let e = exec_command("echo {name} {host}", &info(&name, &api)).unwrap_err();
            assert!(e.to_string().contains("refusing to run --exec"), "{e}");
        }
        assert!(!marker.exists());
    }
}
