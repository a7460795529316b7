"""What each domain of a site can carry now, from the state of its feeds (pure).

A domain's capacity is the sum of the ratings of its feeds that are up, never above its
own rating (a domain without feeds listed: its rating). A UPS on battery carries at most
its ``battery_w`` (when the site file gives one) until its input returns. An operator's
limit on a domain (``SiteState.limits_w``) caps it likewise. A domain whose
feeds are all down carries nothing: the budgets of what it supplies go to zero (their
rows are dark or on a path the tree does not show), never to an unknown.

A feed's state comes from the equipment (a breaker open, a UPS input out of tolerance) or,
for a feed whose meter is powered by it (``loss_means_down``), from the meter going dark;
``FeedState`` says which, and ``feed_up`` decides.

What it must not do: read a clock or a meter; time (the polls since contact) is counted by
the caller.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import TypeVar

from polca.powertree.model import Domain, Feed, SiteTree
from polca.readings import EquipmentState

K = TypeVar("K")

__all__ = [
    "FeedState",
    "SiteState",
    "capacities_w",
    "domain_capacity_w",
    "feed_up",
    "feeds_up_w",
    "fold_feeds",
    "next_feed_state",
]


@dataclass(frozen=True, slots=True)
class FeedState:
    """What is known of one feed: what its equipment says, and how long it has been dark."""

    equipment: EquipmentState = "unknown"
    dark_polls: int = 0
    """Consecutive polls in which none of the feed's meter sources answered."""


@dataclass(frozen=True, slots=True)
class SiteState:
    """The feeds' states, keyed by (domain, feed), and the UPSes on battery."""

    feeds: Mapping[tuple[str, str], FeedState]
    on_battery: frozenset[str] = frozenset()
    dark_polls_down: int = 3
    """Polls without an answer after which a ``loss_means_down`` feed is down."""
    limits_w: Mapping[str, float] = field(default_factory=dict)
    """Operator limits on domains (maintenance, a generator, a grid event), in watts: a
    domain's capacity is never above its limit."""


def feed_up(feed: Feed, state: FeedState | None, *, dark_polls_down: int) -> bool:
    """Whether a feed counts as up: its equipment has not said down, and (where its meter
    is powered by it) its meter has not been dark for ``dark_polls_down`` polls. A feed
    nothing is known of yet is up (the site starts on its design)."""
    if state is None:
        return True
    if state.equipment == "down":
        return False
    return not (feed.loss_means_down and feed.sources and state.dark_polls >= dark_polls_down)


def feeds_up_w(
    feeds: Sequence[Feed], states: Mapping[str, FeedState], *, dark_polls_down: int
) -> float:
    """The ratings of the ``feeds`` that are up, summed (``states`` keyed by feed name)."""
    return sum(
        feed.rating_w
        for feed in feeds
        if feed_up(feed, states.get(feed.name), dark_polls_down=dark_polls_down)
    )


def next_feed_state(
    feed: Feed,
    previous: FeedState | None,
    *,
    equipment: Mapping[str, EquipmentState],
    dark: AbstractSet[str],
) -> FeedState | None:
    """A feed's state after one meter report, or None when the report has none of its sources.

    ``equipment`` is what each answering source says of its feed, ``dark`` the sources that
    did not answer (loss of contact). The feed's equipment is up when any of its sources
    says up, down when one says down and none up (and stays down until one says up),
    else unknown; it is dark for one more
    poll when every source of it in the report is dark, and its count starts again at the
    first answer.
    """
    answered = [equipment[name] for name in feed.sources if name in equipment]
    silent = [name for name in feed.sources if name in dark]
    if not answered and not silent:
        return None
    if "up" in answered:
        said: EquipmentState = "up"
    elif "down" in answered:
        said = "down"
    elif previous is not None and (previous.equipment == "down" or not answered):
        said = previous.equipment  # down until it says up; dark: what it last said stands
    else:
        said = "unknown"
    dark_polls = (previous.dark_polls if previous is not None else 0) + 1 if not answered else 0
    return FeedState(said, dark_polls)


def fold_feeds(
    feeds: Mapping[K, Feed],
    states: MutableMapping[K, FeedState],
    *,
    equipment: Mapping[str, EquipmentState],
    dark: AbstractSet[str],
    dark_polls_down: int,
) -> bool:
    """Fold one meter report into the ``states`` of ``feeds`` (each keyed as the caller
    keeps them: a row's feed name, a domain's ``(domain, feed)``); True when a feed went
    up or down by it (``feed_up``), which is when the budgets must be looked at again."""
    moved = False
    for key, feed in feeds.items():
        before = states.get(key)
        after = next_feed_state(feed, before, equipment=equipment, dark=dark)
        if after is None:
            continue
        states[key] = after
        was_up = feed_up(feed, before, dark_polls_down=dark_polls_down)
        moved |= was_up != feed_up(feed, after, dark_polls_down=dark_polls_down)
    return moved


def domain_capacity_w(domain: Domain, state: SiteState) -> float:
    """What ``domain`` can carry with the feeds that are up now."""
    capacity = domain.rating_w
    if domain.feeds:
        states = {
            feed.name: found
            for feed in domain.feeds
            if (found := state.feeds.get((domain.name, feed.name))) is not None
        }
        capacity = min(
            capacity, feeds_up_w(domain.feeds, states, dark_polls_down=state.dark_polls_down)
        )
    if domain.name in state.on_battery and domain.battery_w is not None:
        capacity = min(capacity, domain.battery_w)
    limit_w = state.limits_w.get(domain.name)
    if limit_w is not None:
        capacity = min(capacity, limit_w)
    return capacity


def capacities_w(tree: SiteTree, state: SiteState) -> dict[str, float]:
    """Every domain's capacity now."""
    return {name: domain_capacity_w(domain, state) for name, domain in tree.domains.items()}
