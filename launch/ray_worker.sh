#!/usr/bin/env bash
# A worker node of a multi-node engine (deploy/k8s/overlays/multinode-ray runs it in each worker pod):
# joins the leader's Ray head and stays in the foreground until stopped.
#
#   RAY_LEADER=HOST bash launch/ray_worker.sh
#
#   RAY_LEADER           the leader's address (LeaderWorkerSet sets LWS_LEADER_ADDRESS, used when unset)
#   RAY_PORT             the head's port (6379)
#   RAY_NODE_ARGS        more `ray start` arguments (e.g. "--num-cpus 1")
set -euo pipefail
leader=${RAY_LEADER:-${LWS_LEADER_ADDRESS:?RAY_LEADER or LWS_LEADER_ADDRESS: the address of the leader}}
# shellcheck disable=SC2086  # RAY_NODE_ARGS is a list of arguments
exec ray start --address="$leader:${RAY_PORT:-6379}" --block \
  --disable-usage-stats ${RAY_NODE_ARGS:-}
