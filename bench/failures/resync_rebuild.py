#!/usr/bin/env python3
"""Resync and rebuild throughput on a lab cluster.

Starts a 4-node lab, fills a mirror-3 volume, kills the node holding most copies, writes
a part of the volume while it is away, restarts it and times the delta resync; then kills
it again for good and times the rebuild of its copies elsewhere (repair delay 5 s). Prints
bytes copied and MB/s (from the owner's converge_repair_bytes_copied_total), with the
resync_bytes_per_s throttle in force (knob default 256 MiB/s).

    bench/failures/resync_rebuild.py [--size 2G] [--changed 256M]
"""
import argparse, json, os, ssl, subprocess, sys, tempfile, time, urllib.request

def sh(*a, **kw):
    return subprocess.run(a, check=True, capture_output=True, text=True, **kw).stdout

def cv(*a):
    return sh("converge", *a)

def cvj(*a):
    return json.loads(cv(*a, "--json"))

def metric(api, name):
    req = urllib.request.Request(api + "/metrics")
    req.add_header("Authorization", "Bearer " + open(os.path.join(os.environ["CONVERGE_LAB_DIR"], "admin.token")).read().strip())
    ctx = ssl.create_default_context(cafile=os.path.join(os.environ["CONVERGE_LAB_DIR"], "pki", "ca.crt"))
    txt = urllib.request.urlopen(req, context=ctx).read().decode()
    return sum(float(l.split()[-1]) for l in txt.splitlines() if l.startswith(name + " ") or l.startswith(name + "{"))

def extents():
    v = cvj("volume", "show", "r")
    return [(s["index"], e["node"], e["state"]) for s in v["slabs"] for e in s["extents"]]

def wait(pred, what, limit=900):
    t0 = time.time()
    while not pred():
        if time.time() - t0 > limit:
            sys.exit(f"gave up waiting for {what}")
        time.sleep(0.2)
    return time.time() - t0

def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="2G")
    p.add_argument("--changed", default="256M")
    a = p.parse_args()
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    os.environ["PATH"] = os.path.join(root, "target/release") + ":" + os.environ["PATH"]
    d = tempfile.mkdtemp(prefix="cvbench")
    os.environ["CONVERGE_LAB_DIR"] = d
    try:
        cv("lab", "up", "--nodes", "4", "--drive-size", "4G", "--repair-delay", "5")
        cv("volume", "create", "r", "--size", a.size, "--resiliency", "mirror-3", "--owner", "1")
        lab = json.load(open(os.path.join(d, "lab.json")))
        api1 = lab["nodes"][0]["api"]
        uri = cvj("volume", "show", "r")["uri"]
        fio = ["fio", "--name=b", "--ioengine=nbd", f"--uri={uri}", "--verify_state_save=0",
               "--output-format=terse"]
        sh(*fio, "--rw=write", "--bs=1M", "--iodepth=8", f"--size={a.size}")
        ext = extents()
        victim = max(range(2, 5), key=lambda n: sum(1 for e in ext if e[1] == n))
        held = sum(1 for e in ext if e[1] == victim)
        cv("lab", "fault", "kill", str(victim))
        sh(*fio, "--rw=randwrite", "--bs=64k", "--iodepth=8", f"--size={a.size}",
           f"--io_size={a.changed}", "--randrepeat=0")
        b0 = metric(api1, "converge_repair_bytes_copied_total")
        cv("lab", "fault", "restart", str(victim))
        t = wait(lambda: all(e[2] == "in-sync" for e in extents()), "resync")
        b1 = metric(api1, "converge_repair_bytes_copied_total")
        print(f"resync: node {victim} held {held} slabs; {(b1-b0)/2**20:.0f} MiB differed and were copied "
              f"in {t:.1f} s (from restart, incl. node start-up) = {(b1-b0)/2**20/t:.0f} MiB/s")
        cv("lab", "fault", "kill", str(victim))
        t = wait(lambda: all(e[1] != victim and e[2] == "in-sync" for e in extents()), "rebuild")
        b2 = metric(api1, "converge_repair_bytes_copied_total")
        print(f"rebuild: {held} slabs, {(b2-b1)/2**20:.0f} MiB copied in {t:.1f} s "
              f"(from kill, incl. lease expiry ~6 s and repair delay 5 s) = {(b2-b1)/2**20/t:.0f} MiB/s")
    finally:
        subprocess.run(["converge", "lab", "down", "--purge"], capture_output=True)

if __name__ == "__main__":
    main()
