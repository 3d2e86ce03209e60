package PVE::Storage::Plugin;

# A stand-in for Proxmox VE's storage plugin base class, for testing ConvergePlugin.pm on a
# machine without Proxmox VE: the plugin overrides every method PVE calls, so the base
# class only needs to exist.

use strict;
use warnings;

1;
