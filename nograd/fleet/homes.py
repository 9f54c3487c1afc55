"""Each model's home replica as the balancer places it, and homes made even by the replicas'
weights. HAProxy's ring places each name by a draw of its hash, so a few dozen models rarely
split evenly: one replica can be the home of more models than its memory holds while another
holds few, and the first then evicts and reloads in turn. A replica with fewer points on the
ring (a lower weight) is the home of fewer names, and changing a weight moves only the names
on the points it adds or takes away: a few steps of the weights even the homes."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Final

import httpx

from nograd.fleet.balancer import BalancerError, RuntimeApi

REPLICA_HEADER: Final = "x-nograd-replica"
"""Set by the balancer on every HTTP answer: the slot that answered (``replica<N>``)."""
WEIGHT: Final = 50
"""Each replica's weight as ``nograd fleet`` starts it: half the weight deploy/fleet/haproxy.cfg
gives its slots, which is the most HAProxy can raise it to (a slot has the ring points of its
configured weight and no more)."""
WEIGHT_STEP: Final = 1
LOWEST_WEIGHT: Final = WEIGHT // 4
HIGHEST_WEIGHT: Final = WEIGHT * 2
"""Weights stay within a quarter and twice the start: a replica keeps a share of the ring
whatever the names, so a model added later still has a fair chance to land on it."""
MOST_STEPS: Final = 80
REQUEST_TIMEOUT_S: Final = 10.0


def model_names(url: str) -> list[str]:
    """The repository's models, from the index a replica answers through the balancer."""
    answer = httpx.post(f"{url}/v2/repository/index", json={}, timeout=REQUEST_TIMEOUT_S)
    if answer.status_code != 200:
        raise BalancerError(f"repository index through {url}: {answer.status_code} {answer.text}")
    return sorted({str(row["name"]) for row in answer.json()})


def homes(url: str, models: Iterable[str]) -> dict[str, int]:
    """Each model's home slot: the replica the balancer sends its metadata call to (answered
    from the model's configuration, so asking loads nothing)."""
    found = {}
    with httpx.Client(base_url=url, timeout=REQUEST_TIMEOUT_S) as http:
        for name in models:
            answer = http.get(f"/v2/models/{name}")
            replica = answer.headers.get(REPLICA_HEADER, "")
            if not replica.startswith("replica"):
                status = answer.status_code
                raise BalancerError(f"{name}: no {REPLICA_HEADER} from {url} ({status})")
            found[name] = int(replica.removeprefix("replica"))
    return found


def spread(found: Mapping[str, int], slots: Iterable[int]) -> Counter[int]:
    """Homes per slot, the slots with none included."""
    counts: Counter[int] = Counter({slot: 0 for slot in slots})
    counts.update(found.values())
    return counts


def _range(counts: Counter[int]) -> int:
    return max(counts.values()) - min(counts.values())


def even_homes(
    api: RuntimeApi, url: str, models: Sequence[str], slots: Sequence[int], allowed: int
) -> dict[str, int]:
    """Step the weights of ``slots`` from where they are until no replica is the home of more
    than ``allowed`` models more than another, or ``MOST_STEPS`` steps: a step scales every
    replica's weight by the square root of its share of the homes against an even share (a
    replica with too many loses points, one with too few gains). The steps move names back and
    forth, so the best weights seen are the ones kept. Within one of ``allowed``, a step takes
    one unit of weight from the replica with the most homes and gives it to the one with the
    fewest. Returns the homes then."""
    weights = {slot: api.weight(slot) for slot in slots}
    found = homes(url, models)
    best = (_range(spread(found, slots)), dict(weights), found)
    even_share = len(models) / len(slots)
    for _ in range(MOST_STEPS):
        counts = spread(found, slots)
        if _range(counts) <= allowed:
            break
        most = max(slots, key=lambda slot: counts[slot])
        fewest = min(slots, key=lambda slot: counts[slot])
        if _range(counts) > allowed + 1:
            stepped = {
                slot: _bounded(round(weights[slot] * math.sqrt(even_share / max(counts[slot], 1))))
                for slot in slots
            }
        else:
            stepped = dict(weights)
        if stepped == weights:
            # Close to even, or the scaling rounds to no change: one unit off the replica with
            # the most homes and onto the one with the fewest, which moves a name or two.
            stepped[most] = _bounded(weights[most] - WEIGHT_STEP)
            stepped[fewest] = _bounded(weights[fewest] + WEIGHT_STEP)
            if stepped == weights:
                break
        _set_weights(api, weights, stepped)
        found = homes(url, models)
        found_range = _range(spread(found, slots))
        if found_range < best[0]:
            best = (found_range, dict(weights), found)
    if best[1] != weights:
        _set_weights(api, weights, best[1])
        found = best[2]
    return found


def _bounded(weight: int) -> int:
    return min(HIGHEST_WEIGHT, max(LOWEST_WEIGHT, weight))


def _set_weights(api: RuntimeApi, weights: dict[int, int], wanted: Mapping[int, int]) -> None:
    """``wanted`` in HAProxy, and in ``weights`` (what HAProxy has)."""
    for slot, weight in wanted.items():
        if weights[slot] != weight:
            api.set_weight(slot, weight)
            weights[slot] = weight


def settle_new(
    api: RuntimeApi, url: str, models: Sequence[str], slots: Sequence[int], new: Sequence[int]
) -> dict[str, int]:
    """Step only the weights of the replicas just added (``new``, among ``slots``) until each is
    the home of an even share of the models, give or take one: a new replica's points take
    names from the others' arcs and giving points back returns those names to where they were,
    so only names between a new replica and the others move, about their share."""
    weights = {slot: api.weight(slot) for slot in new}
    share = len(models) / len(slots)
    found = homes(url, models)

    def off(found: Mapping[str, int]) -> float:
        counts = spread(found, slots)
        return sum(abs(counts[slot] - share) for slot in new)

    best = (off(found), dict(weights), found)
    for _ in range(MOST_STEPS):
        counts = spread(found, slots)
        if all(abs(counts[slot] - share) <= 1 for slot in new):
            break
        stepped = {
            slot: _bounded(round(weights[slot] * math.sqrt(share / max(counts[slot], 1))))
            for slot in new
        }
        for slot in new:
            if stepped[slot] == weights[slot]:
                nudge = WEIGHT_STEP if counts[slot] < share else -WEIGHT_STEP
                stepped[slot] = _bounded(weights[slot] + nudge)
        if stepped == weights:
            break
        _set_weights(api, weights, stepped)
        found = homes(url, models)
        found_off = off(found)
        if found_off < best[0]:
            best = (found_off, dict(weights), found)
    if best[1] != weights:
        _set_weights(api, weights, best[1])
        found = best[2]
    return found
