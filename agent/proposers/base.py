"""What the campaign asks of a proposer, and how a batch is shared among several.

Every proposer gets the same request: the problem, its evaluations so far (with their
candidates), the current best, the diverse elites (`agent.population.elites`) and the ids
already seen. A campaign lists proposers per problem in `proposer.kinds`; each is asked for its
share of a batch, and what one does not deliver (the LLM paused by an outage, out of budget, or
out of ideas) passes to the ones after it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from agent.store import EvaluationRow
from sandbox.candidate import Candidate


@dataclass(frozen=True, kw_only=True)
class ProposalRequest:
    campaign_id: str
    problem: str
    rows: list[EvaluationRow]  # the problem's evaluations, oldest first
    best: EvaluationRow | None  # the current best (what selection keeps), if any
    seen: frozenset[str]  # candidate ids already evaluated or in this batch
    # At most `proposer.elites` correct candidates, no two of one lineage, the best first.
    elites: list[EvaluationRow] = field(default_factory=list)


class Proposer(Protocol):
    kind: str

    def propose(self, n: int, request: ProposalRequest) -> list[Candidate]:
        """Up to `n` new candidates (ids not in `request.seen`)."""
        ...

    @property
    def exhausted(self) -> str | None:
        """Why this proposer has nothing more to give, or None while it may still have."""
        ...

    def paused_until(self) -> float | None:
        """Wall-clock time (time.time()) until which it proposes nothing, or None."""
        ...


def allocate(n: int, shares: Sequence[float]) -> list[int]:
    """`n` slots split by `shares` (summing to 1), largest remainders first, ties to the
    earlier proposer."""
    exact = [n * s for s in shares]
    counts = [math.floor(x) for x in exact]
    order = sorted(range(len(shares)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[: n - sum(counts)]:
        counts[i] += 1
    return counts


def propose_batch(
    proposers: Sequence[Proposer], shares: Sequence[float], n: int, request: ProposalRequest
) -> list[Candidate]:
    """A batch of up to `n` from several proposers; a shortfall passes to the next ones."""
    out: list[Candidate] = []
    seen = set(request.seen)
    carry = 0
    for proposer, quota in zip(proposers, allocate(n, shares), strict=True):
        want = quota + carry
        if want <= 0:
            continue
        offered = proposer.propose(want, replace(request, seen=frozenset(seen)))
        got = [c for c in offered if c.id not in seen][:want]
        seen.update(c.id for c in got)
        out += got
        carry = want - len(got)
    return out
