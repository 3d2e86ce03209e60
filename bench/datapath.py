#!/usr/bin/env python3
"""The data path's regression benchmark: converge beside nbdkit and the raw file, side by side.

Runs the same fio points (4 KiB random read and write, QD1 and QD32) against
  raw       a file on the backing store, fio psync with O_DIRECT (one I/O at a time whatever
            the QD: the device's per-I/O cost, the limit the others are held to)
  nbdkit    nbdkit's memory plugin over a unix socket (what the NBD protocol alone costs)
  converge  a mirror-3 volume on a 4-node lab whose drives are on the backing store
in interleaved passes (raw, nbdkit, converge, raw, nbdkit, converge, ...), and measures for
each: IOPS, mean latency, and CPU per I/O (fio's own CPU + the serving processes' CPU from
/proc, so converge's four daemons count, and nbdkit). It reports the medians and, because
absolute numbers drift on a shared machine, the ratios that do not:

  converge IOPS / nbdkit IOPS, converge CPU per I/O / nbdkit's, converge latency - nbdkit's,
  and the capacity write amplification of mirror-3 random writes (bytes the drives wrote /
  bytes fio wrote, from /metrics; 3.0 is the data alone).

Before and after a data-path change:

  bench/datapath.py run --out /tmp/before.json            # on the old build
  bench/datapath.py run --out /tmp/after.json             # on the new build
  bench/datapath.py compare /tmp/before.json /tmp/after.json

`compare` prints each point's ratios side by side and their change. `--bin DIR` runs another
build's converge (e.g. a git worktree of the old commit: `git worktree add /tmp/old <rev> &&
cargo build --release --manifest-path /tmp/old/Cargo.toml`). For a fuller comparison with
Vitastor, use ../shared/peers/ (docs/PERFORMANCE.md).

Needs: scripts/setup.sh done (release build, fio, nbdkit, etcd).
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import ssl
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POINTS = [("randread", 1), ("randwrite", 1), ("randread", 32), ("randwrite", 32)]
HZ = os.sysconf("SC_CLK_TCK")


def sh(args, **kw):
    return subprocess.run(args, check=True, capture_output=True, text=True, **kw).stdout


def proc_cpu_ticks(pids):
    """utime + stime of every thread of these processes, in clock ticks."""
    total = 0
    for p in pids:
        try:
            with open(f"/proc/{p}/stat") as f:
                s = f.read()
        except OSError:
            continue
        x = s[s.rindex(")") + 2:].split()
        total += int(x[11]) + int(x[12])
    return total


def fio(target_args, rw, qd, runtime, size, server_pids):
    args = ["fio", "--name=b", f"--rw={rw}", "--bs=4k", f"--iodepth={qd}",
            f"--size={size}", "--time_based", f"--runtime={runtime}",
            "--randrepeat=0", "--norandommap", "--output-format=json"] + target_args
    t0 = proc_cpu_ticks(server_pids)
    out = sh(args)
    t1 = proc_cpu_ticks(server_pids)
    j = json.loads(out[out.index("{"):])
    job = j["jobs"][0]
    side = job["read"] if rw == "randread" else job["write"]
    ios = side["total_ios"]
    secs = job["job_runtime"] / 1000.0
    client_us = (job["usr_cpu"] + job["sys_cpu"]) / 100.0 * secs * 1e6
    server_us = (t1 - t0) * 1e6 / HZ
    if job["error"] or ios == 0:
        raise RuntimeError(f"fio failed on {target_args}: error {job['error']}, {ios} I/Os")
    return {
        "iops": side["iops"],
        "mean_us": side["lat_ns"]["mean"] / 1000.0,
        "cpu_us_per_io": (client_us + server_us) / ios,
        "client_us_per_io": client_us / ios,
        "bytes": side["io_bytes"],
    }


def get(url, labdir):
    """GET with the lab's admin token (builds older than API tokens ignore it)."""
    req = urllib.request.Request(url)
    try:
        token = open(os.path.join(labdir, "admin.token")).read().strip()
        req.add_header("Authorization", "Bearer " + token)
    except FileNotFoundError:
        pass
    ctx = None
    ca = os.path.join(labdir, "pki", "ca.crt")
    if url.startswith("https://") and os.path.exists(ca):
        ctx = ssl.create_default_context(cafile=ca)
    return urllib.request.urlopen(req, timeout=30, context=ctx).read().decode()


def drive_written(apis, labdir):
    """Bytes every drive of the lab wrote so far (capacity tier), from /metrics."""
    total = 0.0
    for api in apis:
        text = get(api + "/metrics", labdir)
        for line in text.splitlines():
            if line.startswith("converge_drive_written_bytes_total{"):
                total += float(line.rsplit(" ", 1)[1])
    return total


class Targets:
    """raw file, nbdkit and a converge lab, up for the whole run."""

    def __init__(self, store, size, bindir):
        self.store, self.size, self.bindir = store, size, bindir
        self.converge = os.path.join(bindir, "converge")
        base = "/dev/shm" if store == "shm" else "/var/tmp"
        self.work = tempfile.mkdtemp(prefix="cvbench-", dir=base)
        self.labdir = tempfile.mkdtemp(prefix="cvbench-lab-", dir="/tmp")
        self.env = dict(os.environ, CONVERGE_LAB_DIR=self.labdir)
        self.nbdkit = None
        self.raw = os.path.join(self.work, "raw.img")
        sh(["fio", "--name=fill", f"--filename={self.raw}", "--rw=write", "--bs=1M",
            f"--size={size}", "--direct=1", "--output-format=terse"])
        self.sock = os.path.join(self.work, "nbdkit.sock")
        self.nbdkit = subprocess.Popen(
            ["nbdkit", "--foreground", "--unix", self.sock, "memory", size],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(200):
            if os.path.exists(self.sock):
                break
            time.sleep(0.05)
        sh(["nbdcopy", "--", "[", "nbdkit", "pattern", f"size={size}", "]",
            f"nbd+unix:///?socket={self.sock}"])
        up = [self.converge, "lab", "up", "--nodes", "4", "--drives-per-node", "2",
              "--drive-size", "2G", "--dir", self.labdir]
        if store == "shm":
            up.append("--ram")
        subprocess.run(up, check=True, env=self.env, capture_output=True)
        lab = json.load(open(os.path.join(self.labdir, "lab.json")))
        self.apis = [n["api"] for n in lab["nodes"]]
        sh([self.converge, "volume", "create", "bench", "--size", size, "--resiliency",
            "mirror-3", "--owner", "1"], env=self.env)
        self.uri = json.loads(sh([self.converge, "volume", "show", "bench", "--json"],
                                 env=self.env))["uri"]
        sh(["fio", "--name=fill", "--ioengine=nbd", f"--uri={self.uri}", "--rw=write",
            "--bs=1M", "--iodepth=8", f"--size={size}", "--output-format=terse"])
        ps = json.loads(sh([self.converge, "lab", "ps", "--dir", self.labdir, "--json"],
                           env=self.env))
        self.converged = [p["pid"] for p in ps if p.get("pid") and "etcd" not in json.dumps(p)]

    def args(self, target):
        if target == "raw":
            return ["--ioengine=psync", "--direct=1", f"--filename={self.raw}"], []
        if target == "nbdkit":
            return ["--ioengine=nbd", f"--uri=nbd+unix:///?socket={self.sock}"], [self.nbdkit.pid]
        return ["--ioengine=nbd", f"--uri={self.uri}"], self.converged

    def close(self):
        subprocess.run([self.converge, "lab", "down", "--purge", "--dir", self.labdir],
                       env=self.env, capture_output=True)
        if self.nbdkit:
            self.nbdkit.terminate()
            self.nbdkit.wait()
        shutil.rmtree(self.work, ignore_errors=True)
        shutil.rmtree(self.labdir, ignore_errors=True)


def run(a):
    bindir = os.path.abspath(a.bin)
    if not os.path.exists(os.path.join(bindir, "converge")):
        sys.exit(f"no converge build in {bindir}: run scripts/setup.sh (release build) first")
    rev = subprocess.run(["git", "-C", bindir, "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True).stdout.strip()
    t = Targets(a.store, a.size, bindir)
    samples = {f"{rw} QD{qd}": {k: [] for k in ("raw", "nbdkit", "converge")}
               for rw, qd in POINTS}
    wa = []
    try:
        for p in range(a.passes):
            for rw, qd in POINTS:
                point = f"{rw} QD{qd}"
                for target in ("raw", "nbdkit", "converge"):
                    fargs, pids = t.args(target)
                    before = drive_written(t.apis, t.labdir) if target == "converge" else 0
                    r = fio(fargs, rw, qd, a.runtime, a.size, pids)
                    if target == "converge" and rw == "randwrite" and qd == 32:
                        wa.append((drive_written(t.apis, t.labdir) - before) / r["bytes"])
                    samples[point][target].append(r)
                    print(f"pass {p + 1} {point:13} {target:8} {r['iops']:9.0f} IOPS "
                          f"{r['mean_us']:8.1f} µs  {r['cpu_us_per_io']:6.1f} µs CPU/IO",
                          flush=True)
    finally:
        t.close()
    med = {}
    for point, by in samples.items():
        med[point] = {}
        for target, rs in by.items():
            med[point][target] = {k: statistics.median(r[k] for r in rs)
                                  for k in ("iops", "mean_us", "cpu_us_per_io")}
    result = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "rev": rev, "bin": bindir,
              "store": a.store, "runtime_s": a.runtime, "passes": a.passes, "size": a.size,
              "median": med, "samples": samples,
              "write_amplification_qd32": statistics.median(wa) if wa else None}
    print()
    print(table(result))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"\nresults: {a.out}")


def ratios(m):
    c, k = m["converge"], m["nbdkit"]
    return {
        "iops_vs_nbdkit": c["iops"] / k["iops"],
        "cpu_vs_nbdkit": c["cpu_us_per_io"] / k["cpu_us_per_io"],
        "lat_minus_nbdkit_us": c["mean_us"] - k["mean_us"],
        "iops_vs_raw": c["iops"] / m["raw"]["iops"],
    }


def table(res):
    lines = [f"converge {res['rev']} on {res['store']}, {res['passes']} passes of "
             f"{res['runtime_s']} s, medians",
             "| point | raw IOPS | nbdkit IOPS | converge IOPS | converge / nbdkit | "
             "CPU µs/IO converge · nbdkit | CPU ratio | latency µs converge · nbdkit |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for point, m in res["median"].items():
        r = ratios(m)
        c, k = m["converge"], m["nbdkit"]
        lines.append(f"| {point} | {m['raw']['iops']:.0f} | {k['iops']:.0f} | {c['iops']:.0f} | "
                     f"{r['iops_vs_nbdkit']:.2f} | {c['cpu_us_per_io']:.1f} · "
                     f"{k['cpu_us_per_io']:.1f} | {r['cpu_vs_nbdkit']:.2f} | "
                     f"{c['mean_us']:.0f} · {k['mean_us']:.0f} |")
    if res.get("write_amplification_qd32") is not None:
        lines.append(f"\nmirror-3 randwrite QD32 write amplification (drive bytes / fio bytes): "
                     f"{res['write_amplification_qd32']:.3f}")
    return "\n".join(lines)


def compare(a):
    old, new = (json.load(open(p)) for p in (a.before, a.after))
    print(f"before: {old['rev']} ({old['when']}), after: {new['rev']} ({new['when']})")
    print("| point | IOPS / nbdkit before → after | CPU / nbdkit before → after | "
          "latency − nbdkit µs before → after |")
    print("|---|---:|---:|---:|")
    for point in new["median"]:
        if point not in old["median"]:
            continue
        ro, rn = ratios(old["median"][point]), ratios(new["median"][point])
        d = lambda k: (rn[k] / ro[k] - 1) * 100 if ro[k] else 0.0
        print(f"| {point} | {ro['iops_vs_nbdkit']:.3f} → {rn['iops_vs_nbdkit']:.3f} "
              f"({d('iops_vs_nbdkit'):+.0f} %) | {ro['cpu_vs_nbdkit']:.2f} → "
              f"{rn['cpu_vs_nbdkit']:.2f} ({d('cpu_vs_nbdkit'):+.0f} %) | "
              f"{ro['lat_minus_nbdkit_us']:.0f} → {rn['lat_minus_nbdkit_us']:.0f} |")
    wo, wn = old.get("write_amplification_qd32"), new.get("write_amplification_qd32")
    if wo and wn:
        print(f"\nwrite amplification (mirror-3 randwrite QD32): {wo:.3f} → {wn:.3f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="measure raw, nbdkit and converge side by side")
    r.add_argument("--runtime", type=int, default=10, help="seconds per point (default 10)")
    r.add_argument("--passes", type=int, default=3, help="interleaved passes (default 3)")
    r.add_argument("--store", choices=["shm", "disk"], default="shm",
                   help="backing store: /dev/shm (software only, default) or the root disk")
    r.add_argument("--size", default="1G", help="file and volume size (default 1G)")
    r.add_argument("--bin", default=os.path.join(ROOT, "target", "release"),
                   help="directory of the converge build to measure (default: this tree's)")
    r.add_argument("--out", help="write the results as JSON here (for `compare`)")
    c = sub.add_parser("compare", help="ratios of two runs side by side")
    c.add_argument("before")
    c.add_argument("after")
    a = ap.parse_args()
    run(a) if a.cmd == "run" else compare(a)


if __name__ == "__main__":
    main()
