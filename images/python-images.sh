#!/usr/bin/env bash
# `make python-images`: the five Python images (operator, controller, reward, rollout, cpu) on any machine, one that
# reaches no container registry or PyTorch index included: on the pinned python base where it can be pulled, else on
# the base `make base-image` bootstraps from Debian's packages; torch from its index where it answers, else the
# pinned torch's CPU wheel as pip finds it (its index, find-links) for the base's Python, through WHEELHOUSE.
# `make images` does the building (an image whose inputs did not change is not built again); DOCKER as there.
set -euo pipefail
cd "$(dirname "$0")/.."
. images/builder.sh
PYTHON=${PYTHON:-python3}

pinned=$(sed -n 's/^ARG PYTHON_IMAGE=//p' images/controller/Dockerfile)
if [ -z "${PYTHON_IMAGE:-}" ]; then
  if [ -n "$(image_id "$pinned")" ] || timeout 120 "$DOCKER" pull -q "$pinned" >/dev/null 2>&1; then
    PYTHON_IMAGE=$pinned
  else
    echo "python-images: cannot pull $pinned; the base from Debian's packages instead" >&2
    PYTHON_IMAGE=$(bash images/base/build.sh)
  fi
fi
export PYTHON_IMAGE

torch=$(sed -n 's/^ARG TORCH_VERSION=//p' images/cpu/Dockerfile)
index=$(sed -n 's/^ARG TORCH_INDEX_URL=//p' images/cpu/Dockerfile)
if [ -z "${WHEELHOUSE:-}" ] && ! curl -fsS -m 20 -o /dev/null "$index/torch/" 2>/dev/null; then
  case "$(basename "$DOCKER")" in
    buildah) run=(buildah run "$(buildah from -q "$PYTHON_IMAGE")") ;;
    *) run=("$DOCKER" run --rm "$PYTHON_IMAGE") ;;
  esac
  version=$("${run[@]}" python -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  WHEELHOUSE=.cache/wheelhouse
  echo "python-images: $index does not answer; torch $torch+cpu for Python $version from pip into $WHEELHOUSE" >&2
  mkdir -p "$WHEELHOUSE"
  if ! compgen -G "$WHEELHOUSE/torch-$torch+cpu-cp${version/./}-*.whl" >/dev/null; then
    "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$version" \
      --platform manylinux_2_28_x86_64 --dest "$WHEELHOUSE" "torch==$torch+cpu"
  fi
fi
[ -z "${WHEELHOUSE:-}" ] || export WHEELHOUSE

IMAGES="operator controller reward rollout cpu" bash images/build.sh
