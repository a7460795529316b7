"""The node agent: samples GPUs, applies the policy engine's caps, talks MQTT."""

from polca.agent.runtime import Agent

__all__ = ["Agent"]
