//! `converge key`: the cluster key file that wraps encrypted volumes' data keys
//! (docs/adr/0011). The file lives outside etcd, on every node (`[encryption] key_file`
//! in converged.toml); these commands edit one copy of it, which you then copy to every
//! node. A lab's nodes share `DIR/cluster.keys`, the default here when a lab is up.

use anyhow::{anyhow, bail, Result};
use clap::Subcommand;
use converge_api::VolumeInfo;
use converge_pki::keys::Keyring;
use std::path::{Path, PathBuf};

/// Where an installed node keeps the cluster key file.
pub const DEFAULT_KEY_FILE: &str = "/etc/converge/cluster.keys";

#[derive(Subcommand)]
pub enum KeyCmd {
    /// Make a new key file with one random 256-bit key (id 1), mode 0600. Copy it to every
    /// node and name it in each converged.toml's [encryption] key_file.
    Init {
        /// Default: the lab's cluster.keys when a lab is up, else /etc/converge/cluster.keys.
        #[arg(long)]
        file: Option<PathBuf>,
    },
    /// Rotate: add a random key that wraps every volume key from now on. Then copy the
    /// file to every node, re-wrap the volumes (`converge volume rekey --all`) and remove
    /// the old key.
    Add {
        #[arg(long)]
        file: Option<PathBuf>,
    },
    /// The key ids in the file (never the keys), the current one marked, with the volumes
    /// each wraps when the API answers.
    List {
        #[arg(long)]
        file: Option<PathBuf>,
    },
    /// Remove a key from the file; refused for the current key, and while a volume's key
    /// is still wrapped with it (asked of the API; --force skips that check).
    Remove {
        #[arg(long)]
        id: u32,
        #[arg(long)]
        file: Option<PathBuf>,
        #[arg(long)]
        force: bool,
    },
}

fn file_of(file: &Option<PathBuf>) -> PathBuf {
    if let Some(f) = file {
        return f.clone();
    }
    let dir = crate::lab::default_dir();
    if crate::lab::load(&dir).is_ok() {
        return crate::lab::key_file(&dir);
    }
    PathBuf::from(DEFAULT_KEY_FILE)
}

fn load(path: &Path) -> Result<Keyring> {
    Keyring::load(path).map_err(|e| anyhow!("{e}"))
}

/// Volumes whose key each cluster key wraps; `None` when the API does not answer.
fn users(api: Option<&str>) -> Option<Vec<(u32, String)>> {
    let v: Vec<VolumeInfo> = crate::http::call(api?, "GET", "/v1/volumes", None).ok()?;
    Some(
        v.into_iter()
            .filter_map(|v| v.encryption.map(|e| (e.key_id, v.name)))
            .collect(),
    )
}

pub fn run(cmd: &KeyCmd, api: Option<&str>) -> Result<()> {
    match cmd {
        KeyCmd::Init { file } => {
            let path = file_of(file);
            if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
                std::fs::create_dir_all(dir)?;
            }
            Keyring::create(&path).map_err(|e| anyhow!("{e}"))?;
            println!(
                "made {} with cluster key 1 (mode 0600): copy it to every node and set \
                 [encryption] key_file = {:?} in each converged.toml",
                path.display(),
                path.display()
            );
        }
        KeyCmd::Add { file } => {
            let path = file_of(file);
            let mut ring = load(&path)?;
            let id = ring.add().map_err(|e| anyhow!("{e}"))?;
            println!(
                "added cluster key {id} to {}; it wraps new volume keys from now on.\n\
                 Next: copy the file to every node, run `converge volume rekey --all`, then \
                 `converge key remove --id OLD`.",
                path.display()
            );
        }
        KeyCmd::List { file } => {
            let path = file_of(file);
            let ring = load(&path)?;
            let users = users(api);
            let mut t = crate::table::Table::new(&["ID", "CURRENT", "VOLUMES"]);
            for id in ring.ids() {
                let vols = match &users {
                    Some(u) => {
                        let names: Vec<&str> = u
                            .iter()
                            .filter(|(k, _)| *k == id)
                            .map(|(_, n)| n.as_str())
                            .collect();
                        if names.is_empty() {
                            "-".to_string()
                        } else {
                            names.join(",")
                        }
                    }
                    None => "? (API not reachable)".to_string(),
                };
                let cur = if id == ring.current() { "yes" } else { "" };
                t.row(vec![id.to_string(), cur.to_string(), vols]);
            }
            println!("{}", path.display());
            print!("{}", t.render());
        }
        KeyCmd::Remove { id, file, force } => {
            let path = file_of(file);
            let mut ring = load(&path)?;
            if ring.current() == *id {
                bail!(
                    "cluster key {id} is the current key (it wraps new volume keys): add a new \
                     one and re-key the volumes first"
                );
            }
            if !force {
                let Some(u) = users(api) else {
                    bail!(
                        "cannot ask the API which volumes key {id} wraps; start the cluster (or \
                         pass --force if you are sure none does: those volumes could not be \
                         opened again)"
                    );
                };
                let using: Vec<&str> = u
                    .iter()
                    .filter(|(k, _)| k == id)
                    .map(|(_, n)| n.as_str())
                    .collect();
                if !using.is_empty() {
                    bail!(
                        "cluster key {id} still wraps the keys of {}: run `converge volume rekey \
                         --all` first",
                        using.join(", ")
                    );
                }
            }
            ring.remove(*id).map_err(|e| anyhow!("{e}"))?;
            println!(
                "removed cluster key {id} from {}; copy the file to every node",
                path.display()
            );
        }
    }
    Ok(())
}
