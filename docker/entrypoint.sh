#!/usr/bin/env bash
# The image's entrypoint: give this container its own ssh host key, then run the command.
#
# The image holds no host key, so no two containers share one. The key lives in /etc/ssh/host_keys: mount a
# per-node volume there to keep it across container restarts (clients that learned it keep trusting it).
set -euo pipefail

key=${HVDCOMP_SSH_HOST_KEY:-/etc/ssh/host_keys/ssh_host_ed25519_key}  # sshd_config.d/hvdcomp.conf's HostKey
if [ ! -s "$key" ]; then
  install -d -m 700 "$(dirname "$key")"
  rm -f "$key" "$key.pub"
  ssh-keygen -q -t ed25519 -N '' -C "$(hostname)" -f "$key"
fi
exec "$@"
