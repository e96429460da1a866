"""Where a host's chunks are replicated: a ring over the sorted distinct host ids (pure).

``ring_placement(hosts, replicas, domains)`` is called once by ``recovery.group.TierGroup``
(every rank, at the tier's construction, after the first collective gathered every rank's host
id and failure-domain label). The rule, the same on every rank:

* the hosts are sorted (``sorted(set(ids))``) into a ring ``h0, h1, ..., h(n-1)``;
* host ``hi``'s replicas go to the next hosts of the ring, ``h(i+1), h(i+2), ...``, taking first
  the hosts whose failure domain differs from ``hi``'s (in ring order), then those of ``hi``'s own
  domain (in ring order), ``replicas`` hosts in all; without labels that is ``h(i+1) .. h(i+r)``;
* never ``hi`` itself, never one host twice: each chunk lives in ``1 + replicas`` distinct hosts'
  RAM. ``replicas >= len(hosts)`` is a ``ConfigurationError`` (no placement could hold it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..errors import ConfigurationError

__all__ = ["ring_after", "ring_placement", "transfer_pairs"]


def ring_placement(
    hosts: Sequence[str], replicas: int, domains: Mapping[str, str] | None = None
) -> dict[str, tuple[str, ...]]:
    """Each host -> the hosts holding its replicas, in the order chosen (module docstring)."""
    ring = sorted(set(hosts))
    if replicas < 0:
        raise ConfigurationError(f"replicas must be >= 0, got {replicas}")
    if replicas >= len(ring) and replicas > 0:
        raise ConfigurationError(
            f"replicas={replicas} needs at least {replicas + 1} hosts, but the job has {len(ring)} "
            f"({', '.join(ring)}): lower replicas or run on more hosts (a host is UNICKPT_HOST_ID or the host name)"
        )
    domain = dict(domains or {})
    out: dict[str, tuple[str, ...]] = {}
    for host in ring:
        after = ring_after(ring, host)
        mine = domain.get(host, "")
        other = [h for h in after if domain.get(h, "") != mine]
        same = [h for h in after if domain.get(h, "") == mine]
        out[host] = tuple((other + same)[:replicas])
    return out


def ring_after(ring: Sequence[str], host: str) -> list[str]:
    """The other hosts of ``ring`` in ring order from ``host``: its replica targets in that
    order (``ring_placement``), and the order in which a recovery asks holders for what it lacks
    (nearest first: ``restore._fetch_rounds``, ``feed.plan_feed``)."""
    at = list(ring).index(host)
    return [ring[(at + k) % len(ring)] for k in range(1, len(ring))]


def transfer_pairs(placement: Mapping[str, Sequence[str]]) -> list[tuple[str, str]]:
    """Every (origin, target) copy of the placement in one global order (sorted): the order in
    which every rank walks the transfers, so that blocking sends and receives always match."""
    return sorted((origin, target) for origin, targets in placement.items() for target in targets)
