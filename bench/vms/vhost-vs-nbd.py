#!/usr/bin/env python3
"""vhost-user-blk against NBD, side by side, with fio inside a real guest (docs/VMS.md).

A 3-node lab on RAM drives, one mirror-3 volume owned by node 1. The same guest (the
image of `scripts/guest-image.sh --with-fio`: Debian's kernel, busybox, the host's fio)
boots under qemu with that volume as its virtio disk, attached at node 1 in turn:

  nbd    -drive file=nbd+unix:///VOL?socket=node1/nbd.sock,if=virtio,cache=none
  vhost  -device vhost-user-blk-pci on node1's socket (`converge vhost attach`)

and runs fio (libaio, O_DIRECT) for each profile. The two attachments alternate (A B A B)
so the machine's drift hits both alike. Per profile and attachment: IOPS and mean latency
as fio inside the guest saw them, and host CPU per I/O: converged on every node (the
serving node alone too) and qemu, from /proc between the guest's start and end markers of
each fio run (its 1 s ramp included in both the CPU and the I/O count).

Under TCG (this machine: no KVM for a stock guest) the guest's CPU is emulated, so qemu's
CPU and the guest's own costs dominate and the absolute numbers are far below what KVM
reaches; the comparison is of the two attach paths under the same guest.

    bench/vms/vhost-vs-nbd.py [--secs 8] [--runs 2] [--profiles randread:4k:1,...]
                              [--queues 2] [--smp 2] [--out results.json]

Needs a release build (cargo build --release --bins), qemu-system-x86 and fio
(scripts/setup.sh).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
CONVERGE = os.path.join(ROOT, "target", "release", "converge")
TICK = os.sysconf("SC_CLK_TCK")


def sh(*args, **kw):
    return subprocess.run(args, check=True, capture_output=True, text=True, **kw).stdout


def cpu_seconds(pid):
    """utime + stime of a process, in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def boot(image, disk, profiles, secs, mib, smp, node_pids):
    """Boots the guest on `disk` and returns {profile: result} for its fio runs."""
    cmd = [
        "qemu-system-x86_64", "-accel", "tcg", "-m", "512", "-smp", str(smp),
        "-display", "none", "-monitor", "none", "-serial", "stdio", "-no-reboot",
        "-kernel", os.path.join(image, "vmlinuz"),
        "-initrd", os.path.join(image, "initrd.gz"),
        "-append",
        f"console=ttyS0 panic=-1 quiet converge.job=fio converge.mib={mib} "
        f"converge.secs={secs} converge.fio={','.join(profiles)}",
    ]
    if disk.startswith("vhost:"):
        cmd += [
            "-object", "memory-backend-memfd,id=mem,size=512M,share=on",
            "-machine", "memory-backend=mem",
            "-chardev", f"socket,id=vd,path={disk[6:]},reconnect=1",
            "-device", f"vhost-user-blk-pci,chardev=vd,num-queues={smp}",
        ]
    else:
        cmd += ["-drive", f"file={disk},format=raw,if=virtio,cache=none"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    results, start, console = {}, None, []
    for line in p.stdout:
        console.append(line)
        if line.startswith("CONVERGE-FIO-START "):
            start = (time.monotonic(), {n: cpu_seconds(q) for n, q in node_pids.items()},
                     cpu_seconds(p.pid))
        elif line.startswith("CONVERGE-FIO ") and start:
            t1 = time.monotonic()
            nodes1 = {n: cpu_seconds(q) for n, q in node_pids.items()}
            qemu1 = cpu_seconds(p.pid)
            rw, bs, qd, js = line.split(" ", 4)[1:]
            j = json.loads(js)["jobs"][0]
            side = j["read"] if "read" in rw else j["write"]
            ios = side["iops"] * (secs + 1)  # the CPU window holds the 1 s ramp too
            results[f"{rw}:{bs}:{qd}"] = {
                "iops": side["iops"],
                "lat_us": side["lat_ns"]["mean"] / 1000,
                "errors": j["error"],
                "cpu_us_per_io_nodes": sum(nodes1[n] - start[1][n] for n in nodes1) * 1e6 / ios,
                "cpu_us_per_io_node1": (nodes1[1] - start[1][1]) * 1e6 / ios,
                "cpu_us_per_io_qemu": (qemu1 - start[2]) * 1e6 / ios,
                "seconds": t1 - start[0],
            }
            start = None
    p.wait(timeout=60)
    if len(results) != len(profiles):
        sys.exit("the guest did not report every profile:\n" + "".join(console[-40:]) + p.stderr.read())
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--secs", type=int, default=8, help="seconds of each fio run")
    ap.add_argument("--runs", type=int, default=2, help="A B rounds")
    ap.add_argument("--profiles", default="randread:4k:1,randwrite:4k:1,randread:4k:32,randwrite:4k:32")
    ap.add_argument("--smp", type=int, default=2, help="guest vCPUs (and vhost queues)")
    ap.add_argument("--mib", type=int, default=256, help="MiB of the disk fio covers")
    ap.add_argument("--out", help="write the results as JSON here")
    a = ap.parse_args()
    profiles = a.profiles.split(",")
    image = os.path.join(ROOT, "target", "guest-fio")
    subprocess.run([os.path.join(ROOT, "scripts", "guest-image.sh"), "--with-fio", image], check=True)
    lab = tempfile.mkdtemp(prefix="converge-vms-")
    env = dict(os.environ, CONVERGE_LAB_DIR=lab)
    c = lambda *args: sh(CONVERGE, *args, env=env)
    c("lab", "up", "--dir", lab, "--nodes", "3", "--ram")
    try:
        c("volume", "create", "vmbench", "--size", f"{a.mib + 64}M", "--resiliency", "mirror-3", "--owner", "1")
        ps = json.loads(c("lab", "ps", "--json"))
        node_pids = {int(n["name"].removeprefix("node")): n["pid"] for n in ps
                     if n["name"].startswith("node")}
        sock = os.path.join(lab, "node1", "nbd.sock")
        nbd = f"nbd+unix:///vmbench?socket={sock}"
        # Fill the disk once so reads read data.
        sh("fio", "--name=fill", "--ioengine=nbd", f"--uri={nbd}", "--rw=write", "--bs=1M",
           f"--size={a.mib}M", "--iodepth=8")
        v = json.loads(c("vhost", "attach", "vmbench", "--node", "1", "--queues", str(a.smp), "--json"))
        vhost = "vhost:" + v["socket"]
        runs = {"nbd": [], "vhost": []}
        for r in range(a.runs):
            for name, disk in (("nbd", nbd), ("vhost", vhost)):
                res = boot(image, disk, profiles, a.secs, a.mib, a.smp, node_pids)
                runs[name].append(res)
                print(f"round {r + 1} {name}: " + ", ".join(
                    f"{p} {res[p]['iops']:.0f} IOPS" for p in profiles), flush=True)
    finally:
        subprocess.run([CONVERGE, "lab", "down", "--dir", lab], env=env, capture_output=True)

    def median(xs):
        xs = sorted(xs)
        return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2

    summary = {}
    print()
    print(f"{'profile':<18} {'path':<6} {'IOPS':>8} {'lat us':>8} {'cpu us/io':>10} "
          f"{'node1':>8} {'qemu':>8}   vhost/nbd IOPS")
    for p in profiles:
        row = {}
        for name in ("nbd", "vhost"):
            m = {k: median([r[p][k] for r in runs[name]]) for k in
                 ("iops", "lat_us", "cpu_us_per_io_nodes", "cpu_us_per_io_node1", "cpu_us_per_io_qemu")}
            m["errors"] = sum(r[p]["errors"] for r in runs[name])
            row[name] = m
        ratio = row["vhost"]["iops"] / row["nbd"]["iops"] if row["nbd"]["iops"] else float("nan")
        row["vhost_over_nbd_iops"] = ratio
        summary[p] = row
        for name in ("nbd", "vhost"):
            m = row[name]
            print(f"{p:<18} {name:<6} {m['iops']:>8.0f} {m['lat_us']:>8.0f} "
                  f"{m['cpu_us_per_io_nodes']:>10.1f} {m['cpu_us_per_io_node1']:>8.1f} "
                  f"{m['cpu_us_per_io_qemu']:>8.1f}" + (f"   {ratio:.2f}" if name == "vhost" else ""))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"args": vars(a), "summary": summary, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
