//! Mirror-accelerated parity's rotation job (docs/adr/0009): for each volume with a mirror
//! part that this node serves, when the mirror part is above its high watermark, the spans
//! written least recently are rotated into parity, one at a time and throttled like
//! repair (the resync rate), until it is at its low watermark. Each rotation is listed in
//! JOBS while it runs (kind `rotate`).

use crate::node::{Node, Vol};
use converge_types::{SlabIndex, ROTATE_HIGH_PCT, ROTATE_LOW_PCT};
use converge_volume::Rotated;
use std::sync::Arc;
use std::time::Duration;

/// How often the mirror parts are looked at.
const CHECK_EVERY: Duration = Duration::from_secs(2);

pub async fn run(node: Arc<Node>) {
    loop {
        tokio::time::sleep(CHECK_EVERY).await;
        let vols: Vec<(String, Arc<Vol>)> = node
            .volumes
            .lock()
            .await
            .iter()
            .filter(|(_, v)| v.mirror_part_usage().is_some())
            .map(|(n, v)| (n.clone(), v.clone()))
            .collect();
        for (name, v) in vols {
            rotate(&node, &name, &v).await;
        }
    }
}

/// Rotates `v`'s coldest spans while its mirror part is over the watermarks.
async fn rotate(node: &Node, name: &str, v: &Vol) {
    let mut continuing = false;
    while !v.is_retired() {
        let Some(u) = v.mirror_part_usage() else {
            return;
        };
        let pct = if continuing {
            ROTATE_LOW_PCT
        } else {
            ROTATE_HIGH_PCT
        };
        if u.mirror_bytes <= u.limit_bytes * pct / 100 {
            return;
        }
        let job = node.jobs.begin(
            node.cfg.node_id,
            "rotate",
            name,
            SlabIndex(0),
            format!(
                "mirror part {} of {} MiB used: its coldest span moves into parity",
                u.mirror_bytes >> 20,
                u.limit_bytes >> 20
            ),
        );
        match v
            .rotate_once(continuing, &node.throttle, &job.progress)
            .await
        {
            Ok(Rotated::Span { .. }) => continuing = true,
            Ok(Rotated::Nothing) => return,
            Err(e) => {
                log::warn!("volume {name}: rotation into parity stopped: {e}");
                return;
            }
        }
    }
}
