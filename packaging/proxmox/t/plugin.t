#!/usr/bin/perl
# Tests PVE::Storage::Custom::ConvergePlugin against a real converge cluster (a lab), the
# way Proxmox VE calls it: alloc, list, size, the paths and blockdev options qemu gets
# (checked with qemu-io and qemu-img on the real socket), snapshot, rollback, linked clone,
# resize, status, free, and the refusals. Environment: CONVERGE_API, CONVERGE_TOKEN,
# CONVERGE_CA (`converge lab env`), CONVERGE_CLI (the converge binary), CONVERGE_SOCKET (a
# node's NBD socket). Run by crates/cli/tests/proxmox.rs.

use strict;
use warnings;
use FindBin;
use lib "$FindBin::Bin/lib", "$FindBin::Bin/..";
use Test::More;

require 'ConvergePlugin.pm';
my $p = 'PVE::Storage::Custom::ConvergePlugin';
my $store = 'cv';
my $scfg = {
    'converge-socket'     => $ENV{CONVERGE_SOCKET},
    'converge-cli'        => $ENV{CONVERGE_CLI},
    'converge-resiliency' => 'mirror-2',
};

# qemu-io on `$path` (read-only with `$ro`, as a snapshot's export is).
sub qemu_io {
    my ($path, $cmd, $ro) = @_;
    my $flag = $ro ? '-r' : '';
    my $out = `qemu-io $flag -f raw -c '$cmd' '$path' 2>&1`;
    return ($? == 0 && $out !~ /Pattern verification failed|error/i, $out);
}

is($p->type, 'converge', 'type');
is($p->api, 12, 'API version');
ok($p->activate_storage($store, $scfg), 'the socket is there');
eval { $p->activate_storage($store, { %$scfg, 'converge-socket' => '/nonexistent' }) };
like($@, qr/no NBD socket/, 'a missing socket is refused');

# A new disk for VM 100: 64 MiB (PVE sizes are KiB).
my $vol = $p->alloc_image($store, $scfg, 100, 'raw', undef, 64 * 1024);
is($vol, 'vm-100-disk-0', 'the first free name');
is(scalar $p->volume_size_info($scfg, $store, $vol), 64 << 20, 'its size');
my $imgs = $p->list_images($store, $scfg, 100);
is_deeply([map { $_->{volid} } @$imgs], ["$store:$vol"], 'listed for VM 100');
is_deeply($p->list_images($store, $scfg, 999), [], 'not for another VM');
is($p->alloc_image($store, $scfg, 100, 'raw', undef, 1024), 'vm-100-disk-1', 'the next name');
$p->free_image($store, $scfg, 'vm-100-disk-1');

# What qemu is handed opens the volume.
my $path = scalar $p->path($scfg, $vol, $store);
is($path, "nbd:unix:$ENV{CONVERGE_SOCKET}:exportname=$vol", 'legacy path');
my ($ok, $out) = qemu_io($path, 'write -P 0x5a 0 1M');
ok($ok, "qemu writes through the path: $out");
my $bd = $p->qemu_blockdev_options($scfg, $store, $vol, 'pc-q35-10.0', {});
is_deeply($bd, { driver => 'nbd', server => { type => 'unix', path => $ENV{CONVERGE_SOCKET} },
    export => $vol }, 'blockdev options');
my $opts = "driver=nbd,server.type=unix,server.path=$bd->{server}{path},export=$bd->{export}";
$out = `qemu-img info --image-opts '$opts' 2>&1`;
like($out, qr/virtual size: 64 MiB/, "qemu-img opens the blockdev: $out");

# Snapshot, overwrite, roll back.
$p->volume_snapshot($scfg, $store, $vol, 'snap1');
($ok, $out) = qemu_io($path, 'write -P 0x77 0 1M');
ok($ok, "overwrite: $out");
my $snap_path = scalar $p->path($scfg, $vol, $store, 'snap1');
($ok, $out) = qemu_io($snap_path, 'read -P 0x5a 0 1M', 1);
ok($ok, "the snapshot's export reads what it held: $out");
$p->volume_snapshot_rollback($scfg, $store, $vol, 'snap1');
($ok, $out) = qemu_io($path, 'read -P 0x5a 0 1M');
ok($ok, "rolled back: $out");
ok($p->volume_has_feature($scfg, 'snapshot', $store, $vol), 'snapshots');
ok($p->volume_has_feature($scfg, 'clone', $store, $vol, 'snap1'), 'clones of snapshots');
ok(!$p->volume_has_feature($scfg, 'clone', $store, $vol), 'no clones of templates');
is($p->volume_qemu_snapshot_method($store, $scfg, $vol), 'storage', 'storage snapshots');

# A linked clone for VM 101.
my $clone = $p->clone_image($scfg, $store, $vol, 101, 'snap1');
is($clone, 'vm-101-disk-0', 'the clone');
($ok, $out) = qemu_io(scalar $p->path($scfg, $clone, $store), 'read -P 0x5a 0 1M');
ok($ok, "the clone reads the snapshot: $out");
eval { $p->clone_image($scfg, $store, $vol, 102) };
like($@, qr/needs a snapshot/, 'a clone without a snapshot is refused');

# Grow.
$p->volume_resize($scfg, $store, $vol, 128 << 20, 0);
is(scalar $p->volume_size_info($scfg, $store, $vol), 128 << 20, 'resized');
eval { $p->volume_resize($scfg, $store, $vol, 32 << 20, 0) };
like($@, qr/shrink|smaller|refused/i, 'shrinking is refused');

my ($total, $free, $used, $active) = $p->status($store, $scfg);
ok($total > 0 && $used > 0 && $active, "status: $total total, $used used");

# The snapshot has a clone: the volume cannot go first.
eval { $p->free_image($store, $scfg, $vol) };
like($@, qr/clone/i, 'a volume whose snapshot a clone reads is kept');
$p->free_image($store, $scfg, $clone);
$p->volume_snapshot_delete($scfg, $store, $vol, 'snap1');
$p->volume_snapshot($scfg, $store, $vol, 'snap2');
$p->free_image($store, $scfg, $vol);
is_deeply($p->list_images($store, $scfg, undef), [], 'all freed (with their snapshots)');

# Refusals.
eval { $p->parse_volname('not-a-disk') };
like($@, qr/unable to parse/, 'a foreign name');
eval { $p->alloc_image($store, $scfg, 100, 'qcow2', undef, 1024) };
like($@, qr/only raw/, 'qcow2');
eval { $p->alloc_image($store, $scfg, 100, 'raw', 'vm-7-disk-0', 1024) };
like($@, qr/illegal name/, "another VM's name");
eval { $p->create_base($store, $scfg, $vol) };
like($@, qr/templates are not supported/, 'templates');

done_testing();
