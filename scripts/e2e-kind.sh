#!/usr/bin/env bash
# `make e2e-kind`: the whole Kubernetes path on a real (kind) cluster, where Docker and kind exist.
#
#   1. creates a kind cluster (or reuses one of the same name),
#   2. builds the CPU all-in-one image (images/cpu) and loads it into the cluster,
#   3. installs the chart (release `areal`, namespace `areal`, charts/areal/ci/kind-values.yaml) and runs `helm test`,
#   4. builds the demo assets onto the claim `areal-demo-assets` with a one-off Job in that image
#      (examples/k8s/demo-assets.yaml),
#   5. applies examples/rljob-demo-cpu.yaml and waits until the RLJob's status.policyVersion reaches
#      E2E_MIN_VERSION (default 2): the controller, reward service, rollout worker, CPU engine and trainer are
#      training, with Redis, the operator and the NetworkPolicies of the chart in the way.
#
# Needs: docker (with a running engine), kind, kubectl, helm (3.14+ or 4). Environment:
#   KIND_CLUSTER=areal-e2e     cluster name            KIND_NODE_IMAGE=...    kind node image (default: kind's)
#   KEEP_CLUSTER=1             leave the cluster       SKIP_BUILD=1           use an already built image
#   E2E_MIN_VERSION=2          version to wait for     E2E_TIMEOUT=1800       seconds for the RLJob to get there
set -euo pipefail
cd "$(dirname "$0")/.."

CLUSTER=${KIND_CLUSTER:-areal-e2e}
NAMESPACE=areal          # the example's Redis Secret is the chart's `areal-redis`: release and namespace `areal`
RELEASE=areal
VERSION=$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml)
IMAGE=ghcr.io/areal-k8s/cpu:${VERSION}
MIN_VERSION=${E2E_MIN_VERSION:-2}
TIMEOUT=${E2E_TIMEOUT:-1800}
JOB=demo

log() { printf '\n==> %s\n' "$*" >&2; }
die() { printf 'e2e-kind: %s\n' "$*" >&2; exit 1; }

for tool in docker kind kubectl helm; do
  command -v "$tool" >/dev/null 2>&1 || die "needs $tool on PATH (docker, kind, kubectl, helm)"
done
docker info >/dev/null 2>&1 || die "no Docker engine (docker info failed)"

KUBECTL=(kubectl --context "kind-${CLUSTER}")
HELM=(helm --kube-context "kind-${CLUSTER}")

diagnose() {
  log "diagnostics"
  "${KUBECTL[@]}" get rljobs,pods,deployments,statefulsets,pvc,networkpolicies -n "$NAMESPACE" -o wide || true
  "${KUBECTL[@]}" describe rljob "$JOB" -n "$NAMESPACE" || true
  "${KUBECTL[@]}" get events -n "$NAMESPACE" --sort-by=.lastTimestamp | tail -n 40 || true
  for pod in $("${KUBECTL[@]}" get pods -n "$NAMESPACE" -o name 2>/dev/null); do
    echo "--- $pod" >&2
    "${KUBECTL[@]}" logs -n "$NAMESPACE" "$pod" --all-containers --tail=40 || true
  done
}

finish() {
  local status=$?
  if [ "$status" -ne 0 ]; then
    diagnose
  fi
  if [ -z "${KEEP_CLUSTER:-}" ]; then
    log "deleting kind cluster $CLUSTER (KEEP_CLUSTER=1 keeps it)"
    kind delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true
  fi
  exit "$status"
}

# 1. the cluster
if kind get clusters 2>/dev/null | grep -qx "$CLUSTER"; then
  log "reusing kind cluster $CLUSTER"
else
  log "creating kind cluster $CLUSTER"
  kind create cluster --name "$CLUSTER" ${KIND_NODE_IMAGE:+--image "$KIND_NODE_IMAGE"} --wait 180s
fi
trap finish EXIT

# 2. the image
if [ -z "${SKIP_BUILD:-}" ]; then
  log "building $IMAGE"
  IMAGES=cpu images/build.sh
fi
log "loading $IMAGE into $CLUSTER"
kind load docker-image "$IMAGE" --name "$CLUSTER"

# 3. the chart. Helm installs crds/ only on first install: apply the CRD first, so a reused cluster gets the
# current one too (the upgrade path of charts/areal/README.md).
log "installing the chart"
"${KUBECTL[@]}" apply --server-side --force-conflicts -f charts/areal/crds/
"${HELM[@]}" upgrade --install "$RELEASE" charts/areal --namespace "$NAMESPACE" --create-namespace \
  -f charts/areal/ci/kind-values.yaml --wait --timeout 10m
"${KUBECTL[@]}" wait --for=condition=Established "crd/rljobs.areal-k8s.dev" --timeout=60s
"${HELM[@]}" test "$RELEASE" --namespace "$NAMESPACE" --timeout 5m

# 4. the demo assets (a tiny Qwen2 and the addition task), built in the cluster onto a claim
log "building the demo assets onto claim areal-demo-assets"
# examples/k8s/demo-assets.yaml names the image by the package version, as $IMAGE does
if ! "${KUBECTL[@]}" get job areal-demo-assets -n "$NAMESPACE" >/dev/null 2>&1; then
  "${KUBECTL[@]}" apply -n "$NAMESPACE" -f examples/k8s/demo-assets.yaml
fi
"${KUBECTL[@]}" wait --for=condition=Complete job/areal-demo-assets -n "$NAMESPACE" --timeout=1200s

# 5. the RLJob
log "submitting examples/rljob-demo-cpu.yaml"
"${KUBECTL[@]}" apply -n "$NAMESPACE" -f examples/rljob-demo-cpu.yaml
deadline=$((SECONDS + TIMEOUT))
while :; do
  version=$("${KUBECTL[@]}" get rljob "$JOB" -n "$NAMESPACE" -o jsonpath='{.status.policyVersion}' 2>/dev/null || true)
  failed=$("${KUBECTL[@]}" get rljob "$JOB" -n "$NAMESPACE" \
    -o jsonpath='{.status.conditions[?(@.type=="Failed")].status}' 2>/dev/null || true)
  "${KUBECTL[@]}" get rljob "$JOB" -n "$NAMESPACE" --no-headers 2>/dev/null || true
  [ "$failed" = "True" ] && die "the RLJob failed"
  if [ -n "$version" ] && [ "$version" -ge "$MIN_VERSION" ]; then
    break
  fi
  [ "$SECONDS" -lt "$deadline" ] || die "policy version ${version:-none} after ${TIMEOUT}s, waiting for $MIN_VERSION"
  sleep 10
done
log "ok: RLJob $JOB reached policy version $version"
"${KUBECTL[@]}" get rljobs -n "$NAMESPACE"
