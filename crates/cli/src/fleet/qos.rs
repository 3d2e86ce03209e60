//! `converge fleet qos`: the noisy-neighbour study (docs/QOS.md). On one node, a victim
//! volume (a VM's disk: 4 KiB random, 70 % reads, a modest queue) runs beside noisy
//! neighbours (4 KiB random writes, deep queues) in four phases: the victim alone; with the
//! neighbours; with a reservation on the victim; with limits on the neighbours instead.
//! Each phase's IOPS and latencies go to OUT/qos.md and qos.json, with whether the
//! reservation held and how close each neighbour came to its limit.

use super::*;
use serde::Serialize;

#[derive(Args, Clone)]
pub struct QosArgs {
    /// Directory for the results (must not exist, or be empty).
    #[arg(long)]
    out: PathBuf,
    /// The node that owns every volume of the study and runs its workers (default: the
    /// first live node). QoS is enforced by a volume's owner, so neighbours contend there.
    #[arg(long)]
    node: Option<u32>,
    /// Resiliency of the study's volumes.
    #[arg(long, default_value = "mirror-2")]
    resiliency: String,
    /// Each volume's size, written once before the phases.
    #[arg(long, default_value = "256M")]
    working_set: String,
    /// Warm-up of each phase, not measured (the limits' burst is spent in it).
    #[arg(long, default_value = "3s")]
    warmup: String,
    /// Measured time of each phase.
    #[arg(long, default_value = "10s")]
    duration: String,
    /// The victim's queue depth.
    #[arg(long, default_value_t = 4)]
    victim_qd: u32,
    /// Noisy neighbours, and the queue depth of each.
    #[arg(long, default_value_t = 2)]
    noisy: u32,
    #[arg(long, default_value_t = 32)]
    noisy_qd: u32,
    /// The victim's reservation in phase 3 (default: 80 % of what it did alone).
    #[arg(long, value_name = "IOPS")]
    reserve: Option<u64>,
    /// Each neighbour's limit in phase 4 (default: a quarter of what it did in phase 2).
    #[arg(long, value_name = "IOPS")]
    limit: Option<u64>,
    /// Keep the volumes at the end.
    #[arg(long)]
    keep: bool,
}

/// One worker's result in a phase.
#[derive(Clone, Debug, Serialize)]
struct Load {
    volume: String,
    qos: String,
    iops: f64,
    lat_mean_us: f64,
    lat_p99_us: Option<f64>,
}

#[derive(Clone, Debug, Serialize)]
struct Phase {
    name: &'static str,
    victim: Load,
    noisy: Vec<Load>,
}

#[derive(Debug, Serialize)]
struct Study {
    node: NodeId,
    resiliency: String,
    working_set_bytes: u64,
    warmup_s: u64,
    duration_s: u64,
    victim_qd: u32,
    noisy_qd: u32,
    reserve_iops: u64,
    limit_iops: u64,
    phases: Vec<Phase>,
    /// The victim's IOPS with the reservation over the reservation.
    reservation_met: f64,
    /// Each neighbour's IOPS with the limit over the limit.
    limit_ratios: Vec<f64>,
}

fn set_qos(api: &str, volume: &str, q: converge_types::Qos) -> Result<()> {
    let body = serde_json::to_value(converge_api::VolumeSettings {
        compression: None,
        qos: Some(q),
    })?;
    let _: Value = http::call(
        api,
        "POST",
        &format!("/v1/volumes/{volume}/settings"),
        Some(&body),
    )
    .with_context(|| format!("setting QoS of {volume}"))?;
    Ok(())
}

pub fn run(a: &QosArgs, json: bool, api: &str) -> Result<()> {
    let secs =
        |v: &str, flag: &str| profile::parse_duration_s(v).map_err(|e| anyhow!("{flag}: {e}"));
    let warmup_s = secs(&a.warmup, "--warmup")?;
    let duration_s = secs(&a.duration, "--duration")?;
    let ws = parse_size(&a.working_set).context("--working-set")?;
    let resiliency: Resiliency = a
        .resiliency
        .parse()
        .map_err(|e| anyhow!("--resiliency: {e}"))?;
    if !(1..=8).contains(&a.noisy) {
        bail!("--noisy {}: give 1 to 8 neighbours", a.noisy);
    }
    if a.reserve == Some(0) || a.limit == Some(0) {
        bail!("--reserve and --limit are above 0");
    }
    check_out_dir(&a.out)?;
    let status: Status =
        http::call(api, "GET", "/v1/status", None).context("reading the cluster's status")?;
    let live: Vec<_> = status.nodes.iter().filter(|n| n.live).collect();
    let owner = match a.node {
        Some(id) => live
            .iter()
            .find(|n| n.id.0 == id)
            .ok_or_else(|| anyhow!("--node {id}: no live node {id}"))?,
        None => live.first().ok_or_else(|| anyhow!("no live node"))?,
    };
    if live.len() < resiliency.copies() {
        bail!(
            "{resiliency} needs {} live nodes; the cluster has {}",
            resiliency.copies(),
            live.len()
        );
    }
    let napi = node_api(&owner.api_addr);
    let info: FleetNode = http::call(&napi, "GET", "/v1/fleet/node", None)
        .with_context(|| format!("asking node {} for its fleet information", owner.id))?;
    if let Some(e) = &info.fio_error {
        bail!("node {} cannot run fleet workers: {e}", owner.id);
    }
    let nodes = vec![NodeCtx {
        id: owner.id,
        api: napi,
        info,
        runs_workers: true,
    }];
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    install_signal_handlers();
    let mut progress = Progress::new();
    let mut session = Session::new(api, &nodes, a.keep);
    let r = study(
        a,
        &mut session,
        &mut progress,
        resiliency,
        ws,
        warmup_s,
        duration_s,
    );
    session.cleanup(&mut progress);
    let st = r?;
    std::fs::write(a.out.join("qos.json"), serde_json::to_vec_pretty(&st)?)?;
    let md = render(&st);
    std::fs::write(a.out.join("qos.md"), &md)?;
    if json {
        println!("{}", serde_json::to_string_pretty(&st)?);
    } else {
        print!("{md}");
        println!("\nwritten: {}", a.out.join("qos.md").display());
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn study(
    a: &QosArgs,
    s: &mut Session,
    progress: &mut Progress,
    resiliency: Resiliency,
    ws: u64,
    warmup_s: u64,
    duration_s: u64,
) -> Result<Study> {
    let node = s.nodes[0].id;
    let victim = volume_name(node, 1);
    let noisy: Vec<String> = (2..=a.noisy + 1).map(|k| volume_name(node, k)).collect();
    for name in std::iter::once(&victim).chain(&noisy) {
        check_interrupt()?;
        progress.status(&format!("creating volume {name}"));
        let body = serde_json::to_value(CreateVolume {
            name: name.clone(),
            size_bytes: ws,
            resiliency,
            owner: Some(node),
            min_replicas: None,
            mirror_part_bytes: None,
            compression: None,
            encrypt: false,
            qos: None,
        })?;
        let _: Value = http::call(s.api, "POST", "/v1/volumes", Some(&body))
            .with_context(|| format!("creating volume {name}"))?;
        s.created.push(name.clone());
    }
    // Written once, so every read reaches the copies.
    let spec = |name: &str, volume: &str, kind, qd, write_pct| WorkerSpec {
        name: name.into(),
        volume: volume.into(),
        kind,
        bs_bytes: if kind == WorkerKind::Prefill {
            prefill_bs(ws)
        } else {
            4096
        },
        qd,
        write_pct,
        random_pct: if kind == WorkerKind::Prefill { 0 } else { 100 },
        size_bytes: ws,
        ramp_s: warmup_s,
        runtime_s: duration_s,
        compress_pct: 0,
        dedupe_pct: 0,
        vm: None,
    };
    for (k, v) in std::iter::once(&victim).chain(&noisy).enumerate() {
        s.start_worker(
            0,
            &spec(&format!("qos-prefill-{k}"), v, WorkerKind::Prefill, 4, 100),
        )?;
    }
    wait_workers(s, progress, "pre-filling the study's volumes")?;
    s.delete_workers();

    let mut phases: Vec<Phase> = Vec::new();
    let none = converge_types::Qos::default();
    let mut run_phase = |s: &mut Session, name: &'static str, with_noisy: bool| -> Result<Phase> {
        progress.line(&format!("phase: {name}"));
        s.start_worker(
            0,
            &spec("qos-victim", &victim, WorkerKind::Measure, a.victim_qd, 30),
        )?;
        if with_noisy {
            for (k, v) in noisy.iter().enumerate() {
                s.start_worker(
                    0,
                    &spec(
                        &format!("qos-noisy-{k}"),
                        v,
                        WorkerKind::Measure,
                        a.noisy_qd,
                        100,
                    ),
                )?;
            }
        }
        wait_workers(s, progress, name)?;
        let vols: Vec<converge_api::VolumeInfo> = http::call(s.api, "GET", "/v1/volumes", None)?;
        let qos_of = |v: &str| {
            vols.iter()
                .find(|x| x.name == v)
                .map_or("?".into(), |x| x.qos.to_string())
        };
        let mut loads = Vec::new();
        for &(ni, id) in &s.workers {
            let v: Value = http::call(
                &s.nodes[ni].api,
                "GET",
                &format!("/v1/fleet/workers/{id}/result"),
                None,
            )?;
            let w: WorkerStatus = http::call(
                &s.nodes[ni].api,
                "GET",
                &format!("/v1/fleet/workers/{id}"),
                None,
            )?;
            let job = fio::from_value(&v).map_err(|e| anyhow!("{name}: {e}"))?;
            if job.error != 0 {
                bail!("{name}: fio error {} on {}", job.error, w.spec.volume);
            }
            let mut h = job.read.hist.clone();
            h.merge(&job.write.hist);
            let ios = (job.read.ios + job.write.ios).max(1) as f64;
            loads.push(Load {
                volume: w.spec.volume.clone(),
                qos: qos_of(&w.spec.volume),
                iops: job.read.iops + job.write.iops,
                lat_mean_us: (job.read.lat_mean_ns * job.read.ios as f64
                    + job.write.lat_mean_ns * job.write.ios as f64)
                    / ios
                    / 1000.0,
                lat_p99_us: h.percentile(99.0).map(|ns| ns as f64 / 1000.0),
            });
        }
        s.delete_workers();
        let vi = loads
            .iter()
            .position(|l| l.volume == victim)
            .ok_or_else(|| anyhow!("{name}: no result from the victim"))?;
        let v = loads.remove(vi);
        progress.line(&format!(
            "  victim {} IOPS (mean {:.0} µs); neighbours {}",
            v.iops.round(),
            v.lat_mean_us,
            loads
                .iter()
                .map(|l| format!("{}", l.iops.round()))
                .collect::<Vec<_>>()
                .join(", ")
        ));
        Ok(Phase {
            name,
            victim: v,
            noisy: loads,
        })
    };
    phases.push(run_phase(s, "victim alone", false)?);
    phases.push(run_phase(s, "with noisy neighbours", true)?);
    let reserve = a
        .reserve
        .unwrap_or((phases[0].victim.iops * 0.8).round().max(1.0) as u64);
    set_qos(
        s.api,
        &victim,
        converge_types::Qos {
            iops_reserve: Some(reserve),
            ..none
        },
    )?;
    phases.push(run_phase(s, "victim reserved", true)?);
    set_qos(s.api, &victim, none)?;
    let noisy_before: f64 =
        phases[1].noisy.iter().map(|l| l.iops).sum::<f64>() / phases[1].noisy.len() as f64;
    let limit = a
        .limit
        .unwrap_or((noisy_before / 4.0).round().max(1.0) as u64);
    for v in &noisy {
        set_qos(
            s.api,
            v,
            converge_types::Qos {
                iops_limit: Some(limit),
                ..none
            },
        )?;
    }
    phases.push(run_phase(s, "neighbours limited", true)?);
    let reservation_met = phases[2].victim.iops / reserve as f64;
    let limit_ratios = phases[3]
        .noisy
        .iter()
        .map(|l| l.iops / limit as f64)
        .collect();
    Ok(Study {
        node,
        resiliency: resiliency.to_string(),
        working_set_bytes: ws,
        warmup_s,
        duration_s,
        victim_qd: a.victim_qd,
        noisy_qd: a.noisy_qd,
        reserve_iops: reserve,
        limit_iops: limit,
        phases,
        reservation_met,
        limit_ratios,
    })
}

fn wait_workers(s: &Session, progress: &mut Progress, what: &str) -> Result<()> {
    let t = Instant::now();
    loop {
        sleep_until(Instant::now() + POLL)?;
        let running = s.check_workers()?;
        progress.status(&format!(
            "{what}: {running} workers running ({})",
            fmt::duration_s(t.elapsed().as_secs_f64())
        ));
        if running == 0 {
            return Ok(());
        }
    }
}

fn render(st: &Study) -> String {
    use std::fmt::Write as _;
    let mut o = String::new();
    let _ = writeln!(o, "# Noisy neighbours and QoS (`converge fleet qos`)\n");
    let _ = writeln!(
        o,
        "Every volume owned by node {}; {}, {} each, written once first. The victim: 4 KiB \
         random, 70 % reads, QD {}. Each neighbour: 4 KiB random writes, QD {}. Each phase: \
         {} s warm-up, {} s measured.\n",
        st.node,
        st.resiliency,
        format_size(st.working_set_bytes),
        st.victim_qd,
        st.noisy_qd,
        st.warmup_s,
        st.duration_s
    );
    let _ = writeln!(
        o,
        "| phase | victim QoS | victim IOPS | victim mean | victim p99 | neighbours' QoS | neighbours' IOPS (each) |"
    );
    let _ = writeln!(o, "|---|---|---:|---:|---:|---|---:|");
    let us = |v: Option<f64>| v.map_or("-".into(), |u| format!("{u:.0} µs"));
    for p in &st.phases {
        let _ = writeln!(
            o,
            "| {} | {} | {:.0} | {} | {} | {} | {} |",
            p.name,
            p.victim.qos,
            p.victim.iops,
            us(Some(p.victim.lat_mean_us)),
            us(p.victim.lat_p99_us),
            p.noisy.first().map_or("-".into(), |l| l.qos.clone()),
            if p.noisy.is_empty() {
                "-".into()
            } else {
                p.noisy
                    .iter()
                    .map(|l| format!("{:.0}", l.iops))
                    .collect::<Vec<_>>()
                    .join(", ")
            }
        );
    }
    let held = if st.reservation_met >= 0.9 {
        "held"
    } else {
        "NOT held"
    };
    let _ = writeln!(
        o,
        "\nReservation {} IOPS: the victim did {:.0} beside the neighbours ({:.0} % of it: {held}; \
         {:.0} without it, {:.0} alone).",
        st.reserve_iops,
        st.phases[2].victim.iops,
        100.0 * st.reservation_met,
        st.phases[1].victim.iops,
        st.phases[0].victim.iops
    );
    let within = st.limit_ratios.iter().all(|r| (r - 1.0).abs() <= 0.1);
    let _ = writeln!(
        o,
        "Limit {} IOPS per neighbour: measured {} ({}).",
        st.limit_iops,
        st.limit_ratios
            .iter()
            .map(|r| format!("{:.1} %", 100.0 * r))
            .collect::<Vec<_>>()
            .join(", "),
        if within {
            "within 10 %"
        } else {
            "NOT within 10 % (a neighbour that cannot reach its limit stays below it)"
        }
    );
    o
}
