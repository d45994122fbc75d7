#!/usr/bin/env bash
# `make base-image`: the Python base of the images built from Debian's packages, for a machine that cannot pull the
# pinned python:*-slim image (no registry reachable). debootstrap bootstraps a minimal Debian with its python3,
# venv and pip, laid out as the official image is (python and pip on PATH in /usr/local/bin), and the builder
# imports it FROM scratch. `make images PYTHON_IMAGE=<the printed name>` builds every Python image on it.
#   DOCKER=podman|buildah|docker (default: the first installed), SUITE=bookworm, MIRROR=http://deb.debian.org/debian
# The image carries the build host's CA bundle, so pip inside the builds trusts what the host trusts (a
# TLS-intercepting proxy, say). It is skipped when an image of the same name was built from the same inputs.
set -euo pipefail
cd "$(dirname "$0")"
. ../builder.sh

SUITE=${SUITE:-bookworm}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
BASE_IMAGE=${BASE_IMAGE:-localhost/areal-k8s/python-base:$SUITE}
PACKAGES=python3,python3-venv,python3-pip,ca-certificates

inputs=$({ echo "$SUITE $MIRROR $PACKAGES"; sha256sum build.sh rootfs.Dockerfile /etc/ssl/certs/ca-certificates.crt; } | sha256sum | cut -c1-64)
if [ "$(image_label "$BASE_IMAGE" "$INPUTS_LABEL")" = "$inputs" ]; then
  echo "make base-image: $BASE_IMAGE is up to date" >&2
  echo "$BASE_IMAGE"
  exit 0
fi
command -v debootstrap >/dev/null 2>&1 || { echo "make base-image: debootstrap is missing (apt-get install debootstrap)" >&2; exit 1; }

work=$(mktemp -d "${TMPDIR:-/var/tmp}/areal-base.XXXXXX")
trap 'rm -rf "$work"' EXIT
root="$work/root"
echo "make base-image: debootstrap $SUITE from $MIRROR" >&2
debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$root" "$MIRROR" >"$work/debootstrap.log" 2>&1 \
  || { tail -20 "$work/debootstrap.log" >&2; echo "make base-image: debootstrap failed" >&2; exit 1; }
# as the official image: `python` and `pip` on PATH; the host's trust; no package caches or docs
ln -sf /usr/bin/python3 "$root/usr/local/bin/python"
ln -sf /usr/bin/pip3 "$root/usr/local/bin/pip"
cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root"/usr/share/doc/* "$root"/usr/share/man/* \
  "$root"/var/log/*.log "$root"/var/cache/debconf/*-old
tar --numeric-owner -C "$root" -cf "$work/rootfs.tar" .
cp rootfs.Dockerfile "$work/Dockerfile"
build_image "$BASE_IMAGE" "$work/Dockerfile" "$work" --label "$INPUTS_LABEL=$inputs" >&2
echo "$BASE_IMAGE"
