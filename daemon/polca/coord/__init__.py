"""Coordination between aggregator instances: leader election on etcd and fencing terms."""
