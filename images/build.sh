#!/usr/bin/env bash
# `make images`: build every image of images/ (or those named in IMAGES) from the repository root, tagged
# <IMAGE_REPOSITORY>/<name>:<IMAGE_TAG>. The tag defaults to the package version in pyproject.toml, which is the
# chart's appVersion and the tag the operator gives its default images (tests/cluster/test_images.py keeps them in step).
#   IMAGES="cpu operator" make images        # a subset
#   DOCKER=podman make images                 # the builder: docker, podman or buildah (default: the first found)
#   PYTHON_IMAGE=REF make images              # the Python images on another base (`make base-image` makes one)
#   WHEELHOUSE=DIR make images                # torch from DIR's torch-*.whl, where its index cannot be reached
#   FORCE=1 make images                       # build even the images whose inputs have not changed
#   CHECK=1 images/build.sh                   # build nothing; fail naming each image older than its sources
#   PUSH=1 make images                        # push after building
#   PLATFORM=linux/arm64 make images          # another platform (docker buildx, podman, buildah)
# Every image is labelled with a hash of its sources (the files its context gives the Dockerfile) and one of all its
# inputs (those, its build arguments and wheels, its base): an image already there with the same inputs is not built
# again. CHECK compares the sources only (the container tests run it: they test what the code is now).
set -euo pipefail
cd "$(dirname "$0")/.."
. images/builder.sh

IMAGE_REPOSITORY=${IMAGE_REPOSITORY:-ghcr.io/areal-k8s}
IMAGE_TAG=${IMAGE_TAG:-$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml)}
# every folder of images/ with a Dockerfile; the operator's default images name the same set (names.IMAGE_COMPONENTS)
ALL_IMAGES="operator controller reward rollout sglang trainer cpu"
IMAGES=${IMAGES:-$ALL_IMAGES}
[ -n "$IMAGE_TAG" ] || { echo "make images: no version in pyproject.toml" >&2; exit 1; }
if [ "$DOCKER" = docker ] && ! docker info >/dev/null 2>&1; then
  echo "make images: docker info failed (no Docker engine here?); DOCKER=podman or buildah build without one" >&2
  exit 1
fi

# the torch wheels go into the build context (images/wheelhouse, which the torch images bind at build time)
if [ -z "${CHECK:-}" ]; then rm -f images/wheelhouse/*.whl; fi
if [ -n "${WHEELHOUSE:-}" ] && [ -z "${CHECK:-}" ]; then
  compgen -G "$WHEELHOUSE/torch-*.whl" >/dev/null || { echo "make images: no torch-*.whl in $WHEELHOUSE" >&2; exit 1; }
  for wheel in "$WHEELHOUSE"/torch-*.whl; do
    ln -f "$wheel" images/wheelhouse/ 2>/dev/null || cp "$wheel" images/wheelhouse/
  done
fi

# a hash of the files of the context that images/$1's Dockerfile sees: those .gitignore keeps (as .dockerignore does)
sources() {
  if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    git ls-files -co --exclude-standard -- pyproject.toml setup.py README.md .dockerignore proto services "images/$1"
  else
    find pyproject.toml setup.py README.md .dockerignore proto services "images/$1" -type f \
      ! -path '*/__pycache__/*' ! -name '*_pb2*' ! -name .generated ! -path '*.egg-info/*'
  fi | sort -u | while IFS= read -r file; do [ -f "$file" ] && printf '%s\n' "$file"; done \
    | xargs -d '\n' sha256sum | sha256sum | cut -c1-64
}

stale=
for name in $IMAGES; do
  [ -f "images/$name/Dockerfile" ] || { echo "make images: no images/$name/Dockerfile" >&2; exit 1; }
  ref="$IMAGE_REPOSITORY/$name:$IMAGE_TAG"
  args=(--label "org.opencontainers.image.version=$IMAGE_TAG")
  if [ -n "${PYTHON_IMAGE:-}" ] && grep -q '^ARG PYTHON_IMAGE=' "images/$name/Dockerfile"; then
    args+=(--build-arg "PYTHON_IMAGE=$PYTHON_IMAGE")
  fi
  if [ -n "${WHEELHOUSE:-}" ] && grep -q 'source=images/wheelhouse' "images/$name/Dockerfile"; then
    args+=(--build-arg TORCH_INDEX_URL=)
  fi
  [ -z "${PLATFORM:-}" ] || args+=(--platform "$PLATFORM")
  context=$(sources "$name")
  if [ -n "${CHECK:-}" ]; then
    [ "$(image_label "$ref" "$SOURCES_LABEL")" = "$context" ] || { echo "$ref"; stale=1; }
    continue
  fi
  inputs=$({
    printf '%s\n' "$context" "${args[@]}" "$(image_id "${PYTHON_IMAGE:-}")"
    if [ -n "${WHEELHOUSE:-}" ]; then (cd images/wheelhouse && stat -c '%n %s' -- *.whl); fi
  } | sha256sum | cut -c1-64)
  if [ -z "${FORCE:-}" ] && [ "$(image_label "$ref" "$INPUTS_LABEL")" = "$inputs" ]; then
    echo "==> $ref: up to date (inputs $(echo "$inputs" | cut -c1-12))" >&2
  else
    echo "==> $ref" >&2
    start=$SECONDS
    build_image "$ref" "images/$name/Dockerfile" . "${args[@]}" --label "$SOURCES_LABEL=$context" \
      --label "$INPUTS_LABEL=$inputs"
    echo "==> $ref: built in $((SECONDS - start)) s" >&2
  fi
  if [ -n "${PUSH:-}" ]; then
    "$DOCKER" push "$ref"
  fi
done
[ -z "$stale" ] || { echo "make images: the images above are older than their sources" >&2; exit 1; }
