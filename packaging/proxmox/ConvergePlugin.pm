package PVE::Storage::Custom::ConvergePlugin;

# Proxmox VE storage plugin for converge (docs/VMS.md, "Proxmox VE"). VM disks are converge
# volumes: this plugin creates, resizes, snapshots, rolls back, clones and deletes them
# through the `converge` command (which talks to the cluster's HTTPS API), and hands qemu
# each disk as an NBD source on this node's converge socket (qemu-server 9's blockdev
# options; the legacy `nbd:unix:` path for older ones). Raw images only, content `images`.
#
# Storage configuration (/etc/pve/storage.cfg):
#
#   converge: converge
#       content images
#       converge-socket /run/converge/nbd.sock
#       converge-resiliency mirror-3
#       converge-api https://10.0.0.1:7443,https://10.0.0.2:7443
#       converge-token-file /etc/pve/priv/converge.token
#       converge-ca /etc/converge/pki/ca.crt
#
# Volume names are PVE's own (`vm-<vmid>-disk-<n>`); snapshots are converge snapshots of the
# same name as PVE's; a linked clone of a snapshot is a converge clone (`volume clone`).

use strict;
use warnings;

use IPC::Open3;
use JSON::PP;
use Symbol qw(gensym);

use base qw(PVE::Storage::Plugin);

# Storage API version: 12 is qemu-server's blockdev options (Proxmox VE 9).
sub api {
    return 12;
}

sub type {
    return 'converge';
}

sub plugindata {
    return {
        content => [ { images => 1 }, { images => 1 } ],
        format  => [ { raw => 1 }, 'raw' ],
    };
}

sub properties {
    return {
        'converge-socket' => {
            description => "This node's converge NBD socket (default /run/converge/nbd.sock).",
            type        => 'string',
        },
        'converge-resiliency' => {
            description => "Resiliency of new volumes (simple, mirror-2, mirror-3, parity-K+M; default mirror-3).",
            type        => 'string',
        },
        'converge-api' => {
            description => "The cluster's API endpoints, comma-separated (else CONVERGE_API).",
            type        => 'string',
        },
        'converge-token-file' => {
            description => "A file holding the API token (else CONVERGE_TOKEN).",
            type        => 'string',
        },
        'converge-ca' => {
            description => "The cluster CA certificate (default /etc/converge/pki/ca.crt).",
            type        => 'string',
        },
        'converge-cli' => {
            description => "The converge command (default: converge on PATH).",
            type        => 'string',
        },
    };
}

sub options {
    return {
        nodes                 => { optional => 1 },
        disable               => { optional => 1 },
        content               => { optional => 1 },
        'converge-socket'     => { optional => 1 },
        'converge-resiliency' => { optional => 1 },
        'converge-api'        => { optional => 1 },
        'converge-token-file' => { optional => 1 },
        'converge-ca'         => { optional => 1 },
        'converge-cli'        => { optional => 1 },
    };
}

# Runs `converge --json ARGS`; returns its decoded JSON output (or its text, for commands
# without JSON), dies with converge's own error message.
sub converge {
    my ($scfg, @args) = @_;
    my $cli = $scfg->{'converge-cli'} // 'converge';
    local $ENV{CONVERGE_API} = $scfg->{'converge-api'} if $scfg->{'converge-api'};
    local $ENV{CONVERGE_CA}  = $scfg->{'converge-ca'}  if $scfg->{'converge-ca'};
    my $token;
    if (my $f = $scfg->{'converge-token-file'}) {
        open(my $fh, '<', $f) or die "converge: cannot read the token file $f: $!\n";
        my $t = <$fh>;
        close($fh);
        chomp($t) if defined $t;
        $token = $t;
    }
    local $ENV{CONVERGE_TOKEN} = $token if defined $token;
    my $err = gensym;
    my $pid = open3(my $in, my $out, $err, $cli, '--json', @args);
    close($in);
    my $stdout = do { local $/; <$out> } // '';
    my $stderr = do { local $/; <$err> } // '';
    waitpid($pid, 0);
    if ($? != 0) {
        $stderr =~ s/\s+$//;
        die "converge @args: $stderr\n";
    }
    return undef if $stdout !~ /\S/;
    my $v = eval { JSON::PP->new->decode($stdout) };
    return defined($v) ? $v : $stdout;
}

sub socket_path {
    my ($scfg) = @_;
    return $scfg->{'converge-socket'} // '/run/converge/nbd.sock';
}

# `vm-<vmid>-disk-<n>` (or `base-…`, which converge has no use for): the standard tuple.
sub parse_volname {
    my ($class, $volname) = @_;
    if ($volname =~ m/^((vm|base)-(\d+)-\S+)$/) {
        return ('images', $1, $3, undef, undef, $2 eq 'base', 'raw');
    }
    die "unable to parse converge volume name '$volname'\n";
}

# The export qemu opens: the volume, or its read-only snapshot export VOLUME@SNAPSHOT.
sub export_name {
    my ($name, $snapname) = @_;
    return defined($snapname) ? "$name\@$snapname" : $name;
}

sub filesystem_path {
    my ($class, $scfg, $volname, $snapname) = @_;
    my (undef, $name, $vmid) = $class->parse_volname($volname);
    my $path = 'nbd:unix:' . socket_path($scfg) . ':exportname=' . export_name($name, $snapname);
    return wantarray ? ($path, $vmid, 'images') : $path;
}

sub path {
    my ($class, $scfg, $volname, $storeid, $snapname) = @_;
    return $class->filesystem_path($scfg, $volname, $snapname);
}

# qemu-server 9: the disk as an NBD blockdev on this node's socket. Any node serves any
# volume (forwarding to its owner), so a VM migrated to another node keeps working there.
sub qemu_blockdev_options {
    my ($class, $scfg, $storeid, $volname, $machine_version, $options) = @_;
    my (undef, $name) = $class->parse_volname($volname);
    $options //= {};
    return {
        driver => 'nbd',
        server => { type => 'unix', path => socket_path($scfg) },
        export => export_name($name, $options->{'snapshot-name'}),
    };
}

sub volume_info {
    my ($scfg, $name) = @_;
    my $list = converge($scfg, 'volume', 'list');
    for my $v (@$list) {
        return $v if $v->{name} eq $name;
    }
    return undef;
}

sub alloc_image {
    my ($class, $storeid, $scfg, $vmid, $fmt, $name, $size) = @_;
    die "converge: only raw images (not '$fmt')\n" if $fmt && $fmt ne 'raw';
    if (!$name) {
        my %taken = map { $_->{name} => 1 } @{ converge($scfg, 'volume', 'list') };
        for my $n (0 .. 999) {
            if (!$taken{"vm-$vmid-disk-$n"}) {
                $name = "vm-$vmid-disk-$n";
                last;
            }
        }
        die "converge: no free disk name for VM $vmid\n" if !$name;
    }
    die "converge: illegal name '$name': it must be vm-$vmid-*\n" if $name !~ m/^vm-\Q$vmid\E-/;
    # PVE sizes are KiB.
    converge($scfg, 'volume', 'create', $name, '--size', ($size * 1024) . '',
        '--resiliency', $scfg->{'converge-resiliency'} // 'mirror-3');
    return $name;
}

# Deletes the volume, its snapshots first (converge refuses to delete a volume that has
# some, and a snapshot a clone still reads: that error is passed on).
sub free_image {
    my ($class, $storeid, $scfg, $volname, $isBase, $format) = @_;
    my (undef, $name) = $class->parse_volname($volname);
    my $snaps = converge($scfg, 'volume', 'snapshot', 'list', $name, '--no-space') // [];
    for my $s (reverse @$snaps) {
        converge($scfg, 'volume', 'snapshot', 'delete', $name, $s->{name});
    }
    converge($scfg, 'volume', 'delete', $name);
    return undef;
}

sub list_images {
    my ($class, $storeid, $scfg, $vmid, $vollist, $cache) = @_;
    my $res = [];
    for my $v (@{ converge($scfg, 'volume', 'list') }) {
        my $name = $v->{name};
        next if $name !~ m/^(?:vm|base)-(\d+)-/;
        my $owner = $1;
        my $volid = "$storeid:$name";
        if ($vollist) {
            next if !grep { $_ eq $volid } @$vollist;
        } elsif (defined($vmid)) {
            next if $owner ne $vmid;
        }
        push @$res, {
            volid  => $volid,
            format => 'raw',
            size   => $v->{size_bytes},
            vmid   => $owner,
            used   => $v->{allocated_bytes},
        };
    }
    return $res;
}

# Raw bytes of the cluster's capacity drives (every copy counts in `used`).
sub status {
    my ($class, $storeid, $scfg, $cache) = @_;
    my $st = converge($scfg, 'status');
    my $c = $st->{capacity};
    return ($c->{total_bytes}, $c->{free_bytes}, $c->{used_bytes}, 1);
}

sub activate_storage {
    my ($class, $storeid, $scfg, $cache) = @_;
    my $sock = socket_path($scfg);
    die "converge: no NBD socket at $sock (is converged running on this node?)\n" if !-S $sock;
    return 1;
}

sub deactivate_storage { return 1; }
sub activate_volume    { return 1; }
sub deactivate_volume  { return 1; }

sub volume_size_info {
    my ($class, $scfg, $storeid, $volname, $timeout) = @_;
    my (undef, $name) = $class->parse_volname($volname);
    my $v = volume_info($scfg, $name) or die "converge: no volume $name\n";
    return wantarray ? ($v->{size_bytes}, 'raw', $v->{allocated_bytes}, undef) : $v->{size_bytes};
}

# PVE passes the new size in bytes; converge grows volumes only.
sub volume_resize {
    my ($class, $scfg, $storeid, $volname, $size, $running) = @_;
    my (undef, $name) = $class->parse_volname($volname);
    converge($scfg, 'volume', 'resize', $name, '--size', "$size");
    return $size;
}

sub volume_snapshot {
    my ($class, $scfg, $storeid, $volname, $snap) = @_;
    my (undef, $name) = $class->parse_volname($volname);
    converge($scfg, 'volume', 'snapshot', 'create', $name, $snap);
    return undef;
}

sub volume_snapshot_rollback {
    my ($class, $scfg, $storeid, $volname, $snap) = @_;
    my (undef, $name) = $class->parse_volname($volname);
    converge($scfg, 'volume', 'snapshot', 'rollback', $name, $snap, '--yes');
    return undef;
}

sub volume_snapshot_delete {
    my ($class, $scfg, $storeid, $volname, $snap, $running) = @_;
    my (undef, $name) = $class->parse_volname($volname);
    converge($scfg, 'volume', 'snapshot', 'delete', $name, $snap);
    return undef;
}

# converge takes snapshots itself, crash-consistent, with the VM running.
sub volume_qemu_snapshot_method {
    return 'storage';
}

sub volume_has_feature {
    my ($class, $scfg, $feature, $storeid, $volname, $snapname, $running) = @_;
    my $features = {
        snapshot   => { current => 1, snap => 1 },
        clone      => { snap => 1 },
        copy       => { current => 1, snap => 1 },
        sparseinit => { current => 1 },
    };
    my $key = $snapname ? 'snap' : 'current';
    return $features->{$feature} && $features->{$feature}{$key} ? 1 : undef;
}

# A linked clone: a converge clone of the snapshot (instant; it reads the snapshot's
# blocks until it writes its own). converge clones need a snapshot: templates (base
# images) are not supported.
sub clone_image {
    my ($class, $scfg, $storeid, $volname, $vmid, $snap) = @_;
    die "converge: a linked clone needs a snapshot to clone (templates are not supported)\n"
        if !$snap;
    my (undef, $name) = $class->parse_volname($volname);
    my %taken = map { $_->{name} => 1 } @{ converge($scfg, 'volume', 'list') };
    my $new;
    for my $n (0 .. 999) {
        if (!$taken{"vm-$vmid-disk-$n"}) {
            $new = "vm-$vmid-disk-$n";
            last;
        }
    }
    die "converge: no free disk name for VM $vmid\n" if !$new;
    converge($scfg, 'volume', 'clone', "$name\@$snap", $new);
    return $new;
}

sub create_base {
    my ($class, $storeid, $scfg, $volname) = @_;
    die "converge: templates are not supported; take a snapshot and clone it instead\n";
}

sub rename_volume {
    die "converge: volumes cannot be renamed\n";
}

sub get_formats {
    return { formats => { raw => 1 }, default_format => 'raw' };
}

1;
