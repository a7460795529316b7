"""The agent's last good copy of the aggregator's policy, and the policy it starts with.

While the aggregator's policy is in force, the agent keeps its text as
``<state_dir>/policy.remote.yaml``, so a restart starts from it before any broker is
reachable; the local ``agent.policy_file`` is then only the bootstrap. Small file I/O for
the shell; validation is the policy loader's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from polca.agent.config import AgentSettings
from polca.policy import PolicyStore

REMOTE_POLICY_FILE = "policy.remote.yaml"


def path_of(settings: AgentSettings) -> Path:
    """Where the copy lives."""
    return settings.state_dir / REMOTE_POLICY_FILE


def load_at_start(store: PolicyStore, settings: AgentSettings, log: Any) -> bool:
    """Put the copy in force if there is a valid one, else the policy file; whether the
    copy is in force.

    Raises:
        PolicyError: neither is valid (the agent cannot run without a policy).
    """
    remote = False
    copy = path_of(settings)
    if settings.accept_remote_policy and copy.is_file():
        result = store.replace(copy.read_text(encoding="utf-8"), source=str(copy))
        remote = result.ok
        if not result.ok:
            log.error("policy_copy_invalid", path=str(copy), problems=list(result.errors))
    loaded = store.load_first()
    log.info(
        "policy_loaded", policy=loaded.policy.name, revision=loaded.revision, path=str(loaded.path)
    )
    return remote


def save(settings: AgentSettings, text: str, log: Any) -> None:
    """Keep ``text`` as the last good copy (atomically); a failure is a warning."""
    path = path_of(settings)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
    except OSError as exc:
        log.warning("policy_copy_not_saved", path=str(path), error=str(exc))
