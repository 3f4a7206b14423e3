"""A real local Kubernetes control plane for tests, the demo and hands-on use.

etcd, kube-apiserver, kube-controller-manager and kube-scheduler run as plain processes on 127.0.0.1; kwok
stands in for the kubelet on fake GPU nodes (it moves scheduled pods to Running; no container ever runs).
Beside it, `localredis.RedisServer`: the one local redis-server launcher of the tests, benches and demo.
"""

from colocate_devcluster.cluster import GANG_SCHEDULING, Cluster, ClusterError, ClusterSpec

__all__ = ["GANG_SCHEDULING", "Cluster", "ClusterError", "ClusterSpec"]
