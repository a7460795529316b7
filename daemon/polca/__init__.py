"""polca: datacenter power and thermal control for GPU clusters."""

__version__ = "0.1.0"
