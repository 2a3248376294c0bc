#!/usr/bin/env bash
# Builds the stand-in for the Dockerfile's base image here, where registries are unreachable:
# debootstrap of Debian 12 (minbase, python3), imported as localhost/debian-minbase:bookworm, then
# base.Containerfile adds the pinned torch/torchvision from this machine's wheel index and tags the
# result with the real base's name. Skips what already exists (CI caches nothing; reruns here do).
#   CONTAINERS_CONF=tests/container/containers.conf bash tests/container/base.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
BASE=${BASE:-docker.io/library/python:3.11-slim-bookworm}
MIRROR=${MIRROR:-http://deb.debian.org/debian}

if podman image exists "$BASE"; then echo "base: $BASE exists"; exit 0; fi
if ! podman image exists localhost/debian-minbase:bookworm; then
  root=$(mktemp -d)
  trap 'rm -rf "$root"' EXIT
  echo "base: debootstrap bookworm (about a minute)"
  debootstrap --variant=minbase --include=python3,python3-pip,python-is-python3,ca-certificates \
    bookworm "$root" "$MIRROR" > /tmp/debootstrap.log 2>&1 || { tail -20 /tmp/debootstrap.log; exit 1; }
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
  tar -C "$root" -c . | podman import --change 'CMD ["python3"]' - localhost/debian-minbase:bookworm
fi
echo "base: torch and torchvision from constraints.txt (a few minutes)"
podman build --pull=never -f tests/container/base.Containerfile -t "$BASE" \
  -v /etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/ca-certificates.crt:ro \
  -v /opt/wheels:/opt/wheels:ro -v /opt/pypi:/opt/pypi:ro -v /opt/pypi-more:/opt/pypi-more:ro .
