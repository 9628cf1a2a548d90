#!/usr/bin/env bash
# What the sandboxes of lightning_lite/extras/sandbox.py need, on Debian bookworm, as root (make setup-sandbox):
#
#   1. bubblewrap, docker.io, mmdebstrap, git from apt (only those missing);
#   2. dockerd, when `docker info` fails: no bridge and no iptables rules, so no container network exists at
#      all (sandboxes run `--network none`; the model is reached through a Unix socket), logging to
#      /tmp/ll-dockerd.log;
#   3. the image lightning-lite/sandbox:bookworm, when `docker image inspect` doesn't find it: no registry is
#      reachable, so it is built here, by mmdebstrap from the Debian mirror (python3, python3-pytest, git) and
#      `docker import`. Bookworm like the host, so a host venv bound in read-only finds its python3.11.
#
# Idempotent: a second run checks and returns in about a second. IMAGE, MIRROR and SUITE override the defaults.
set -euo pipefail
IMAGE=${IMAGE:-lightning-lite/sandbox:bookworm}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
SUITE=${SUITE:-bookworm}
LOG=/tmp/ll-dockerd.log
say() { echo "sandbox_setup: $*"; }
die() { echo "sandbox_setup: ERROR: $*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "must run as root (it installs packages, starts dockerd and builds an image): sudo scripts/sandbox_setup.sh (make setup-sandbox uses sudo when not root)"
command -v apt-get >/dev/null || die "no apt-get: this script targets Debian bookworm; install bubblewrap, docker and mmdebstrap yourself"

# 1. Packages, by the command each provides.
missing=()
for pair in bwrap:bubblewrap dockerd:docker.io docker:docker.io mmdebstrap:mmdebstrap git:git; do
  command -v "${pair%%:*}" >/dev/null || missing+=("${pair#*:}")
done
# bwrap shows the tests of a SWE instance the host's system, and they run as /usr/bin/python3 -m pytest (examples/swe)
/usr/bin/python3 -c "import pytest" 2>/dev/null || missing+=(python3-pytest)
if [ ${#missing[@]} -gt 0 ]; then
  pkgs=$(printf '%s\n' "${missing[@]}" | sort -u | tr '\n' ' ')
  say "installing $pkgs"
  apt-get update -q
  # shellcheck disable=SC2086
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q $pkgs
else
  say "bubblewrap, docker.io, mmdebstrap, git, python3-pytest: installed"
fi
bwrap --ro-bind / / --unshare-net --unshare-pid true \
  || die "bwrap is installed but cannot create namespaces (inside an unprivileged container? check kernel.unprivileged_userns_clone / seccomp)"

# 2. The Docker daemon.
if docker info >/dev/null 2>&1; then
  say "dockerd: running"
else
  say "starting dockerd (no bridge, no iptables; log: $LOG)"
  # setsid: its own session, so it outlives the make (and CI step) that started it
  setsid nohup dockerd --bridge=none --iptables=false --ip6tables=false >"$LOG" 2>&1 &
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 0.5; done
  if ! docker info >/dev/null 2>&1; then
    tail -n 20 "$LOG" >&2 || true
    die "dockerd did not answer within 30 s (its log is above and in $LOG): inside a container it needs --privileged; on a host with systemd try: systemctl start docker"
  fi
  say "dockerd: up (storage driver $(docker info --format '{{.Driver}}'))"
fi

# 3. The image.
if docker image inspect "$IMAGE" >/dev/null 2>&1; then
  say "image $IMAGE: present"
else
  say "building $IMAGE: mmdebstrap $SUITE from $MIRROR, then docker import (a few minutes)"
  tmp=$(mktemp -d /tmp/ll-sandbox-image.XXXXXX)
  trap 'rm -rf "$tmp"' EXIT
  start=$(date +%s)
  # variant apt: Essential packages + apt, plus what the sandboxed commands need; no docs, man pages or
  # locales (path-exclude), no apt lists (mmdebstrap's cleanup). The mirror is a snapshot whose Release file
  # may be past its Valid-Until, as the host's apt config already allows. No ca-certificates: there is no
  # network inside, so nothing verifies TLS.
  mmdebstrap --variant=apt --include=python3,python3-pytest,git \
    --aptopt='Acquire::Check-Valid-Until "false"' \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/info/*' \
    "$SUITE" "$tmp/rootfs.tar" "$MIRROR" \
    || die "mmdebstrap failed (output above): is $MIRROR reachable (apt-get update works?); set MIRROR=... for another"
  docker import \
    --change 'CMD ["/bin/bash"]' \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    "$tmp/rootfs.tar" "$IMAGE" >/dev/null
  say "built $IMAGE in $(( $(date +%s) - start )) s (rootfs tarball $(du -h "$tmp/rootfs.tar" | cut -f1))"
fi
size=$(docker image inspect --format '{{.Size}}' "$IMAGE")
say "image $IMAGE: $(( size / 1000000 )) MB; run with: docker run --rm --network none $IMAGE python3 -c pass"
