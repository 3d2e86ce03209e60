#!/usr/bin/env python3
"""etcd soak: does a cluster left running keep its etcd bounded?

Starts a lab (4 nodes by default, each with a RAM cache drive in front of its capacity
drives), creates a mirror-3 volume and runs a light verifying load on it (fio: 4 KiB random
writes at a fixed rate, each block verified while the run goes on), and samples etcd every
--interval: its store revision (every write raises it by one), its database size and how
much of that is live data. Writes samples.csv, summary.json and chart.svg to --out, and
prints revisions/s and the database size over the run. The load is light on purpose: what is
measured is the control plane's own writes and whether compaction keeps the database flat.
`--replot` redraws chart.svg from an earlier run's samples.csv.

    bench/soak/soak.py --duration 1h --out /tmp/soak            # then open /tmp/soak/chart.svg
    bench/soak/soak.py --duration 10m --idle --out /tmp/idle     # no load: an idle cluster

Needs root only for what `converge lab up` needs; etcdctl (Debian's etcd-client).
"""
import argparse, csv, json, os, re, signal, subprocess, sys, tempfile, time


def duration(s):
    m = re.fullmatch(r"(\d+)([smh]?)", s.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"{s!r}: give seconds, or e.g. 90s, 10m, 1h")
    return int(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]


def sh(*a, **kw):
    r = subprocess.run(a, capture_output=True, text=True, **kw)
    if r.returncode != 0:
        sys.exit(f"{' '.join(a)} failed ({r.returncode}):\n{r.stderr}")
    return r.stdout


class Etcd:
    """etcdctl as node 1 reaches etcd (its certificate and the lab's CA)."""

    def __init__(self, lab_dir):
        lab = json.load(open(os.path.join(lab_dir, "lab.json")))
        conf = open(os.path.join(lab_dir, "node1", "converged.toml")).read()
        field = lambda k: re.search(rf'^{k} = "(.*)"$', conf, re.M).group(1)
        self.base = ["etcdctl", f"--endpoints={lab['etcd_endpoint']}",
                     f"--cacert={os.path.join(lab_dir, 'pki', 'ca.crt')}",
                     f"--cert={field('cert_file')}", f"--key={field('key_file')}"]

    def status(self):
        s = json.loads(sh(*self.base, "endpoint", "status", "-w", "json"))[0]["Status"]
        return {"revision": int(s["header"]["revision"]), "db_size": int(s["dbSize"]),
                "db_in_use": int(s.get("dbSizeInUse", s["dbSize"]))}


def chart(rows, path):
    """Database file size and the part of it in use (MiB, left axis) and revisions/s (right
    axis) over time."""
    W, H, L, R, T, B = 900, 380, 70, 70, 30, 50
    t = [r["t_s"] for r in rows]
    size = [r["db_size"] / 2**20 for r in rows]
    used = [r["db_in_use"] / 2**20 for r in rows]
    rate = [r["revisions_per_s"] for r in rows]
    tmax = max(t[-1], 1)
    ymax = max(max(size), 1) * 1.15
    rmax = max(max(rate), 1) * 1.15
    X = lambda v: L + (W - L - R) * v / tmax
    Y = lambda v, m: T + (H - T - B) * (1 - v / m)
    line = lambda xs, ys, m, colour, dash="": (
        f'<polyline fill="none" stroke="{colour}" stroke-width="2" {dash} points="'
        + " ".join(f"{X(a):.1f},{Y(b, m):.1f}" for a, b in zip(xs, ys)) + '"/>')
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
           f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<line x1="{L}" y1="{H-B}" x2="{W-R}" y2="{H-B}" stroke="black"/>',
           f'<line x1="{L}" y1="{T}" x2="{L}" y2="{H-B}" stroke="black"/>',
           f'<line x1="{W-R}" y1="{T}" x2="{W-R}" y2="{H-B}" stroke="black"/>']
    for i in range(6):
        v = ymax * i / 5
        out.append(f'<text x="{L-6}" y="{Y(v, ymax)+4:.1f}" text-anchor="end">{v:.1f}</text>')
        rv = rmax * i / 5
        out.append(f'<text x="{W-R+6}" y="{Y(rv, rmax)+4:.1f}">{rv:.1f}</text>')
        tv = tmax * i / 5
        out.append(f'<text x="{X(tv):.1f}" y="{H-B+18}" text-anchor="middle">{tv/60:.0f}</text>')
    out += [f'<text x="{(L+W-R)/2}" y="{H-10}" text-anchor="middle">minutes</text>',
            f'<text x="{L}" y="{T-10}">etcd database, MiB</text>',
            f'<text x="{W-R}" y="{T-10}" text-anchor="end">revisions/s</text>',
            line(t, size, ymax, "#1f77b4"), line(t, used, ymax, "#2ca02c", 'stroke-dasharray="6,3"'),
            line(t, rate, rmax, "#d62728"),
            f'<text x="{L+10}" y="{T+14}" fill="#1f77b4">file size</text>',
            f'<text x="{L+90}" y="{T+14}" fill="#2ca02c">in use (keys and the history kept)</text>',
            f'<text x="{L+330}" y="{T+14}" fill="#d62728">revisions/s</text>', "</svg>"]
    open(path, "w").write("\n".join(out))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=duration, default=duration("1h"), help="how long (e.g. 1h, 10m)")
    p.add_argument("--interval", type=duration, default=duration("30s"), help="sampling interval")
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--rate-iops", type=int, default=200, help="the verifying load's write rate")
    p.add_argument("--idle", action="store_true", help="no load: an idle cluster")
    p.add_argument("--bin", help="directory with converge and converged (default: target/release)")
    p.add_argument("--out", required=True)
    p.add_argument("--replot", action="store_true", help="only redraw OUT/chart.svg from OUT/samples.csv")
    a = p.parse_args()
    if a.replot:
        rows = [{k: float(v) for k, v in r.items()} for r in csv.DictReader(open(os.path.join(a.out, "samples.csv")))]
        chart(rows, os.path.join(a.out, "chart.svg"))
        return
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    os.environ["PATH"] = (a.bin or os.path.join(root, "target/release")) + ":" + os.environ["PATH"]
    os.makedirs(a.out, exist_ok=True)
    lab_dir = tempfile.mkdtemp(prefix="cvsoak")
    os.environ["CONVERGE_LAB_DIR"] = lab_dir
    fio = None
    try:
        sh("converge", "lab", "up", "--nodes", str(a.nodes), "--ram", "--drive-size", "2G",
           "--cache-drives", "1", "--cache-size", "256M", "--cache-in-ram")
        etcd = Etcd(lab_dir)
        if not a.idle:
            sh("converge", "volume", "create", "soak", "--size", "1G", "--resiliency", "mirror-3", "--owner", "1")
            uri = json.loads(sh("converge", "volume", "show", "soak", "--json"))["uri"]
            fio = subprocess.Popen(
                ["fio", "--name=soak", "--ioengine=nbd", f"--uri={uri}", "--rw=randwrite", "--bs=4k",
                 "--iodepth=4", f"--rate_iops={a.rate_iops}", "--size=512M", "--verify=crc32c",
                 "--verify_backlog=256", "--verify_state_save=0", "--time_based",
                 f"--runtime={a.duration}", "--output-format=json",
                 f"--output={os.path.join(a.out, 'fio.json')}"],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        rows, t0 = [], time.time()
        prev = etcd.status()
        prev_t = t0
        while time.time() - t0 < a.duration:
            time.sleep(min(a.interval, max(0.0, a.duration - (time.time() - t0))))
            now, s = time.time(), etcd.status()
            s["t_s"] = round(now - t0, 1)
            s["revisions_per_s"] = round((s["revision"] - prev["revision"]) / max(now - prev_t, 1e-9), 3)
            rows.append(s)
            prev, prev_t = s, now
            print(f"{s['t_s']/60:6.1f} min  revision {s['revision']:>9}  {s['revisions_per_s']:7.2f}/s  "
                  f"db {s['db_size']/2**20:7.2f} MiB  live {s['db_in_use']/2**20:7.2f} MiB", flush=True)
        fio_errors = None
        if fio:
            _, err = fio.communicate(timeout=a.duration + 600)
            try:
                jobs = json.load(open(os.path.join(a.out, "fio.json")))["jobs"]
                fio_errors = sum(j["error"] for j in jobs)
            except (OSError, ValueError, KeyError):
                fio_errors = f"fio exited {fio.returncode}: {err.strip()[-500:]}"
            fio = None
        with open(os.path.join(a.out, "samples.csv"), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=["t_s", "revision", "revisions_per_s", "db_size", "db_in_use"])
            w.writeheader()
            w.writerows(rows)
        half = rows[len(rows) // 2:] or rows
        total = rows[-1]["revision"] - rows[0]["revision"] if len(rows) > 1 else 0
        span = rows[-1]["t_s"] - rows[0]["t_s"] if len(rows) > 1 else 1
        summary = {
            "duration_s": a.duration, "nodes": a.nodes, "load": None if a.idle else f"{a.rate_iops} IOPS 4k randwrite, verified",
            "revisions_per_s": round(total / max(span, 1e-9), 3),
            "revisions_per_node_minute": round(total / max(span, 1e-9) * 60 / a.nodes, 2),
            "db_size_bytes_first": rows[0]["db_size"], "db_size_bytes_last": rows[-1]["db_size"],
            "db_size_bytes_max": max(r["db_size"] for r in rows),
            "db_size_bytes_second_half_min": min(r["db_size"] for r in half),
            "db_size_bytes_second_half_max": max(r["db_size"] for r in half),
            "db_in_use_bytes_last": rows[-1]["db_in_use"],
            "fio_errors": fio_errors,
        }
        json.dump(summary, open(os.path.join(a.out, "summary.json"), "w"), indent=2)
        chart(rows, os.path.join(a.out, "chart.svg"))
        print(json.dumps(summary, indent=2))
        if fio_errors not in (None, 0):
            sys.exit("the verifying load saw errors")
    finally:
        if fio:
            fio.send_signal(signal.SIGINT)
            fio.wait()
        subprocess.run(["converge", "lab", "down", "--purge"], capture_output=True)


if __name__ == "__main__":
    main()
