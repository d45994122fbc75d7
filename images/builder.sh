# Sourced by images/build.sh and images/base/build.sh: the OCI builder they drive (docker, podman or buildah) and
# what each needs to build on a machine without a container daemon or registry.
DOCKER=${DOCKER:-$(for b in docker podman buildah; do
  if [ "$b" = docker ]; then docker info >/dev/null 2>&1 && { echo docker; break; }
  else command -v "$b" >/dev/null 2>&1 && { echo "$b"; break; }; fi
done)}
[ -n "$DOCKER" ] || { echo "images: no OCI builder here: install docker, podman or buildah" >&2; exit 1; }
# the labels that record what an image was built from (images/build.sh): a hash of its sources, one of all its inputs
SOURCES_LABEL=io.areal-k8s.sources
INPUTS_LABEL=io.areal-k8s.inputs
# podman's containers (python-images.sh runs one) under images/containers.conf unless CONTAINERS_CONF names another:
# it keeps the host's rlimits and uses runc, where podman's defaults fail on some hosts (the file says why)
if [ "$(basename "$DOCKER")" = podman ]; then
  export CONTAINERS_CONF=${CONTAINERS_CONF:-$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/containers.conf}
fi
# podman and buildah with no daemon: chroot isolation (no OCI runtime, cgroups or network namespace needed for the
# RUN steps) on the host's network; buildah caches layers only when asked
case "$(basename "$DOCKER")" in
  podman) BUILD=("$DOCKER" build --isolation chroot --network host) ;;
  buildah) BUILD=("$DOCKER" build --isolation chroot --network host --layers) ;;
  *) BUILD=("$DOCKER" build) ;;
esac

# build_image REF DOCKERFILE CONTEXT [builder arguments...]
build_image() {
  local ref=$1 dockerfile=$2 context=$3
  shift 3
  "${BUILD[@]}" -f "$dockerfile" -t "$ref" "$@" "$context"
}

# image_label REF LABEL: the label's value, empty when the image or the label is missing
image_label() {
  case "$(basename "$DOCKER")" in
    buildah) buildah inspect --type image --format "{{ index .OCIv1.Config.Labels \"$2\" }}" "$1" 2>/dev/null || true ;;
    *) "$DOCKER" image inspect --format "{{ index .Config.Labels \"$2\" }}" "$1" 2>/dev/null || true ;;
  esac
}

# image_id REF: the image's id, empty when REF is empty or not there
image_id() {
  [ -n "$1" ] || return 0
  case "$(basename "$DOCKER")" in
    buildah) buildah inspect --type image --format '{{ .FromImageID }}' "$1" 2>/dev/null || true ;;
    *) "$DOCKER" image inspect --format '{{ .Id }}' "$1" 2>/dev/null || true ;;
  esac
}
