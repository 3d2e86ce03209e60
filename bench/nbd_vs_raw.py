#!/usr/bin/env python3
"""converge vs raw drive vs nbdkit, side by side on the same backing store.

For each backing store (the root disk, then /dev/shm) runs fio 4 KiB randread and
randwrite at QD1 and QD32 against:
  raw      the backing file itself (io_uring, O_DIRECT)
  nbdkit   nbdkit's file plugin serving a file over a unix socket (fio nbd engine)
  simple   a converge volume with one copy, in a 4-node lab
  mirror3  a converge mirror-3 volume in the same lab
and prints IOPS, mean and p99 latency, the ratio to raw (for mirror-3 writes, to raw / 3,
since every write lands on three drives of the same machine), and converge's write
amplification (bytes written to drives / bytes written by fio, from /metrics).

Results are also written as JSON (bench/results/nbd_vs_raw-<time>.json) so runs compare.
Usage: bench/nbd_vs_raw.py [--runtime 10] [--stores disk,shm] [--size 1G]
Needs: scripts/setup.sh done (release build, fio, nbdkit, etcd).
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(ROOT, "target", "release")
CONVERGE = os.path.join(BIN, "converge")


def sh(args, **kw):
    return subprocess.run(args, check=True, capture_output=True, text=True, **kw).stdout


def fio(target_args, rw, qd, runtime, size):
    args = ["fio", "--name=b", f"--rw={rw}", "--bs=4k", f"--iodepth={qd}",
            f"--size={size}", "--time_based", f"--runtime={runtime}", "--ramp_time=1",
            "--randrepeat=0", "--norandommap", "--output-format=json"] + target_args
    out = sh(args)
    j = json.loads(out[out.index("{"):])
    job = j["jobs"][0]
    side = job["read"] if rw == "randread" else job["write"]
    pct = side["clat_ns"].get("percentile", {})
    p99 = pct.get("99.000000", 0) / 1000.0
    return {
        "iops": side["iops"],
        "mean_us": side["lat_ns"]["mean"] / 1000.0,
        "p99_us": p99,
        "bytes": side["io_bytes"],
        "errors": job["error"],
    }


def metrics_written(api):
    """Sum of converge_drive_written_bytes_total over one node's /metrics."""
    text = urllib.request.urlopen(api + "/metrics", timeout=30).read().decode()
    total = 0
    for line in text.splitlines():
        if line.startswith("converge_drive_written_bytes_total{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def cluster_written(lab):
    return sum(metrics_written(n["api"]) for n in lab["nodes"])


def run_store(store_dir, runtime, size, results):
    store = "shm" if store_dir.startswith("/dev/shm") else "disk"
    work = tempfile.mkdtemp(prefix="cvbench-", dir=store_dir)
    labdir = tempfile.mkdtemp(prefix="cvbench-lab-", dir="/tmp")
    env = dict(os.environ, CONVERGE_LAB_DIR=labdir)
    nbdkit = None
    try:
        raw = os.path.join(work, "raw.img")
        sh(["fio", "--name=fill", f"--filename={raw}", "--rw=write", "--bs=1M",
            f"--size={size}", "--direct=1", "--output-format=terse"])
        kit_file = os.path.join(work, "kit.img")
        shutil.copyfile(raw, kit_file)
        sock = os.path.join(work, "nbdkit.sock")
        nbdkit = subprocess.Popen(["nbdkit", "--foreground", "--unix", sock, "file", kit_file],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(100):
            if os.path.exists(sock):
                break
            time.sleep(0.05)
        # The lab: drives under this store (disk: lab dir on the root disk; shm: --ram).
        up = [CONVERGE, "lab", "up", "--nodes", "4", "--drives-per-node", "2",
              "--drive-size", "4G", "--dir", labdir]
        if store == "shm":
            up.append("--ram")
        subprocess.run(up, check=True, env=env, capture_output=True)
        lab = json.load(open(os.path.join(labdir, "lab.json")))
        api = lab["nodes"][0]["api"]
        uris = {}
        for name, res in (("simple", "simple"), ("mirror3", "mirror-3")):
            sh([CONVERGE, "--api", api, "volume", "create", name, "--size", size,
                "--resiliency", res, "--owner", "1"], env=env)
            uri = json.loads(sh([CONVERGE, "--api", api, "volume", "show", name, "--json"],
                                env=env))["uri"]
            uris[name] = uri
            # Pre-fill so reads hit written blocks.
            sh(["nbdcopy", "--", "[", "nbdkit", "pattern", f"size={size}", "]", uri])
        targets = {
            "raw": ["--ioengine=io_uring", "--direct=1", f"--filename={raw}"],
            "nbdkit": ["--ioengine=nbd", f"--uri=nbd+unix:///?socket={sock}"],
            "simple": ["--ioengine=nbd", f"--uri={uris['simple']}"],
            "mirror3": ["--ioengine=nbd", f"--uri={uris['mirror3']}"],
        }
        for rw in ("randread", "randwrite"):
            for qd in (1, 32):
                row = {}
                for t, targs in targets.items():
                    before = cluster_written(lab) if t in ("simple", "mirror3") else 0
                    r = fio(targs, rw, qd, runtime, size)
                    if t in ("simple", "mirror3") and rw == "randwrite":
                        # fio's io_bytes excludes the ramp; the ramp is short, so this
                        # slightly overstates amplification rather than hiding it.
                        after = cluster_written(lab)
                        r["drive_bytes"] = after - before
                    row[t] = r
                    print(f"  {store:4} {rw:9} QD{qd:<2} {t:8} {r['iops']:10.0f} IOPS "
                          f"mean {r['mean_us']:8.1f} us  p99 {r['p99_us']:8.1f} us", flush=True)
                results.append({"store": store, "rw": rw, "qd": qd, "targets": row})
    finally:
        subprocess.run([CONVERGE, "lab", "down", "--purge", "--dir", labdir],
                       env=env, capture_output=True)
        if nbdkit:
            nbdkit.terminate()
            nbdkit.wait()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(labdir, ignore_errors=True)


def report(results):
    lines = []
    lines.append("| store | workload | target | IOPS | mean µs | p99 µs | ratio to raw | WA |")
    lines.append("|---|---|---|---:|---:|---:|---:|---:|")
    for r in results:
        raw = r["targets"]["raw"]["iops"]
        for t, v in r["targets"].items():
            base = raw / 3 if (t == "mirror3" and r["rw"] == "randwrite") else raw
            ratio = v["iops"] / base if base else 0
            note = " (÷3)" if (t == "mirror3" and r["rw"] == "randwrite") else ""
            wa = ""
            if "drive_bytes" in v and v["bytes"]:
                wa = f"{v['drive_bytes'] / v['bytes']:.2f}"
            lines.append(f"| {r['store']} | {r['rw']} QD{r['qd']} | {t} | {v['iops']:.0f} | "
                         f"{v['mean_us']:.1f} | {v['p99_us']:.1f} | {ratio:.2f}{note} | {wa} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runtime", type=int, default=10, help="seconds per point (default 10)")
    ap.add_argument("--stores", default="disk,shm", help="disk, shm or both (default disk,shm)")
    ap.add_argument("--size", default="1G", help="file / volume size (default 1G)")
    a = ap.parse_args()
    if not os.path.exists(CONVERGE):
        sys.exit("build first: scripts/setup.sh (release build)")
    results = []
    for s in a.stores.split(","):
        d = {"disk": "/var/tmp", "shm": "/dev/shm"}[s]
        print(f"== backing store: {s} ({d})", flush=True)
        run_store(d, a.runtime, a.size, results)
    table = report(results)
    print()
    print(table)
    os.makedirs(os.path.join(ROOT, "bench", "results"), exist_ok=True)
    out = os.path.join(ROOT, "bench", "results", time.strftime("nbd_vs_raw-%Y%m%d-%H%M%S.json"))
    with open(out, "w") as f:
        json.dump({"runtime_s": a.runtime, "size": a.size, "results": results}, f, indent=1)
    print(f"\nresults: {out}")


if __name__ == "__main__":
    main()
