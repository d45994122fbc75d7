#!/usr/bin/env bash
# `make images`: build every image of images/ (or those named in IMAGES) from the repository root, tagged
# <IMAGE_REPOSITORY>/<name>:<IMAGE_TAG>. The tag defaults to the package version in pyproject.toml, which is the
# chart's appVersion and the tag the operator gives its default images (tests/cluster/test_images.py keeps them in step).
#   IMAGES="cpu operator" make images        # a subset
#   PUSH=1 make images                        # push after building
#   PLATFORM=linux/arm64 make images          # docker buildx --platform
set -euo pipefail
cd "$(dirname "$0")/.."

DOCKER=${DOCKER:-docker}
IMAGE_REPOSITORY=${IMAGE_REPOSITORY:-ghcr.io/areal-k8s}
IMAGE_TAG=${IMAGE_TAG:-$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml)}
# every folder of images/ with a Dockerfile; the operator's default images name the same set (names.IMAGE_COMPONENTS)
ALL_IMAGES="operator controller reward rollout sglang trainer cpu"
IMAGES=${IMAGES:-$ALL_IMAGES}

if ! command -v "$DOCKER" >/dev/null 2>&1 || ! "$DOCKER" info >/dev/null 2>&1; then
  echo "make images: no Docker engine here ($DOCKER info failed); build on a machine with one" >&2
  exit 1
fi
[ -n "$IMAGE_TAG" ] || { echo "make images: no version in pyproject.toml" >&2; exit 1; }

for name in $IMAGES; do
  [ -f "images/$name/Dockerfile" ] || { echo "make images: no images/$name/Dockerfile" >&2; exit 1; }
  ref="$IMAGE_REPOSITORY/$name:$IMAGE_TAG"
  echo "==> $ref" >&2
  if [ -n "${PLATFORM:-}" ]; then
    "$DOCKER" buildx build --platform "$PLATFORM" --load -f "images/$name/Dockerfile" -t "$ref" \
      --label "org.opencontainers.image.version=$IMAGE_TAG" .
  else
    "$DOCKER" build -f "images/$name/Dockerfile" -t "$ref" --label "org.opencontainers.image.version=$IMAGE_TAG" .
  fi
  if [ -n "${PUSH:-}" ]; then
    "$DOCKER" push "$ref"
  fi
done
