"""Proposers: where candidates come from (the offline knob search, the LLM), and how a campaign
builds the ones its config asks for."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from agent.proposers.base import ProposalRequest, Proposer, allocate, propose_batch
from agent.proposers.search import SearchProposer

if TYPE_CHECKING:
    from agent.config import CampaignConfig
    from agent.llm.client import ChatClient
    from agent.store import Store

__all__ = ["ProposalRequest", "Proposer", "SearchProposer", "allocate", "make_proposers", "propose_batch"]


def make_proposers(
    config: CampaignConfig, store: Store, campaign_id: str, events=None, client: ChatClient | None = None
) -> dict[str, list[Proposer]]:
    """Problem -> its proposers, in the order of `proposer.kinds`. The LLM proposers of all
    problems share one endpoint (one client, one outage state, one budget)."""
    from search_space.template import get_template

    endpoint = None
    if "llm" in config.proposer.kinds:
        from agent.proposers.llm import LLMEndpoint

        assert config.llm is not None  # the config's validation says so
        endpoint = LLMEndpoint(config.llm, config.budget, store, campaign_id, events, client)
    out: dict[str, list[Proposer]] = {}
    for problem in config.problems:
        proposers: list[Proposer] = []
        for kind in config.proposer.kinds:
            if kind == "search":
                template = get_template(problem).restricted(config.proposer.space.get(problem, {}))
                proposers.append(
                    SearchProposer(template, sampler=config.proposer.sampler, seed=config.proposer.seed)
                )
            else:
                from agent.proposers.llm import LLMProposer

                assert endpoint is not None
                proposers.append(
                    LLMProposer(problem, endpoint, seed=config.proposer.seed, rejections=_rejections(config))
                )
        out[problem] = proposers
    return out


def _rejections(config: CampaignConfig) -> Callable[[str], list[str]]:
    """The reviewers' reasons for rejecting an op's kernels, in the repository the campaign opens
    changes in (read whether or not this campaign opens any: earlier ones may have)."""
    from agent import review

    repo = review.review_repo(config)

    def reasons(op: str) -> list[str]:
        try:
            return review.rejections(repo, op)
        except review.ReviewError:
            return []

    return reasons
