"""Where each GPU's priority class comes from: MQTT, Kubernetes, a file, a batch scheduler."""
