"""What each domain of a site can carry now, from the state of its feeds (pure).

A domain's capacity is the sum of the ratings of its feeds that are up, never above its
own rating (a domain without feeds listed: its rating). A UPS on battery carries at most
its ``battery_w`` (when the site file gives one) until its input returns. A domain whose
feeds are all down carries nothing: the budgets of what it supplies go to zero (their
rows are dark or on a path the tree does not show), never to an unknown.

A feed's state comes from the equipment (a breaker open, a UPS input out of tolerance) or,
for a feed whose meter is powered by it (``loss_means_down``), from the meter going dark;
``FeedState`` says which, and ``feed_up`` decides.

What it must not do: read a clock or a meter; time (the polls since contact) is counted by
the caller.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from polca.powertree.model import Domain, Feed, SiteTree
from polca.readings import EquipmentState

__all__ = ["FeedState", "SiteState", "capacities_w", "domain_capacity_w", "feed_up"]


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


def feed_up(feed: Feed, state: FeedState | None, *, dark_polls_down: int) -> bool:
    """Whether a feed counts as up: its equipment has not said down, and (where its meter
    is powered by it) its meter has not been dark for ``dark_polls_down`` polls. A feed
    nothing is known of yet is up (the site starts on its design)."""
    if state is None:
        return True
    if state.equipment == "down":
        return False
    return not (feed.loss_means_down and feed.sources and state.dark_polls >= dark_polls_down)


def domain_capacity_w(domain: Domain, state: SiteState) -> float:
    """What ``domain`` can carry with the feeds that are up now."""
    capacity = domain.rating_w
    if domain.feeds:
        up_w = sum(
            feed.rating_w
            for feed in domain.feeds
            if feed_up(
                feed,
                state.feeds.get((domain.name, feed.name)),
                dark_polls_down=state.dark_polls_down,
            )
        )
        capacity = min(capacity, up_w)
    if domain.name in state.on_battery and domain.battery_w is not None:
        capacity = min(capacity, domain.battery_w)
    return capacity


def capacities_w(tree: SiteTree, state: SiteState) -> dict[str, float]:
    """Every domain's capacity now."""
    return {name: domain_capacity_w(domain, state) for name, domain in tree.domains.items()}
