"""The Kubernetes adapter (off in local mode): quarantine cordons and taints the node, an operator's
release undoes it, and racks come from the Kubernetes nodes' labels."""
