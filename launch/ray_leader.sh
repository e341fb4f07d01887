#!/usr/bin/env bash
# The leader of a multi-node engine (deploy/k8s/overlays/multinode-ray runs it in the leader pod):
# starts the Ray head, waits until the group's nodes have joined, then serves over the cluster.
# The other nodes run launch/ray_worker.sh. Needs `ray`, `python` and `dynamo-spec` on PATH.
#
#   LWS_GROUP_SIZE=2 bash launch/ray_leader.sh [--section.field VALUE ...]
#
#   LWS_GROUP_SIZE       nodes in the group, this one included (LeaderWorkerSet sets it)
#   RAY_PORT             the head's port (6379)
#   RAY_HEAD_ARGS        more `ray start --head` arguments (e.g. "--num-cpus 1 --temp-dir DIR")
#   RAY_ADDRESS          where `serve` and the wait find the cluster ("auto": the head started here)
#   DYNAMO_SPEC_CONFIG   the config to serve (/etc/dynamo-spec/config.yaml, the ConfigMap)
set -euo pipefail
nodes=${LWS_GROUP_SIZE:?LWS_GROUP_SIZE: the number of nodes in the group}
export RAY_ADDRESS=${RAY_ADDRESS:-auto}
# shellcheck disable=SC2086  # RAY_HEAD_ARGS is a list of arguments
ray start --head --port="${RAY_PORT:-6379}" --disable-usage-stats ${RAY_HEAD_ARGS:-}
until python - "$nodes" <<'PY'
import os, sys
import ray
ray.init(address=os.environ["RAY_ADDRESS"], logging_level="ERROR", log_to_driver=False)
alive = sum(node["Alive"] for node in ray.nodes())
print(f"ray_leader: {alive} of {sys.argv[1]} Ray nodes up", flush=True)
sys.exit(alive < int(sys.argv[1]))
PY
do sleep 5; done
exec dynamo-spec serve --config "${DYNAMO_SPEC_CONFIG:-/etc/dynamo-spec/config.yaml}" "$@"
