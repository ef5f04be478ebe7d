"""The campaign graph: plan -> propose -> evaluate -> select -> plan ... -> register -> END.

Built at module level; `compile(checkpointer)` gives a runnable graph whose every step is
checkpointed, so `recforge campaign resume` continues after a crash or a kill.
"""

from __future__ import annotations

from langgraph.checkpoint.base import BaseCheckpointSaver
from langgraph.graph import END, START, StateGraph

from agent import nodes
from agent.state import CampaignContext, CampaignState

builder = StateGraph(CampaignState, context_schema=CampaignContext)
builder.add_node("plan", nodes.plan)
builder.add_node("propose", nodes.propose)
builder.add_node("evaluate", nodes.evaluate)
builder.add_node("select", nodes.select)
builder.add_node("register", nodes.register)
builder.add_edge(START, "plan")
builder.add_conditional_edges("plan", nodes.route_after_plan)
builder.add_conditional_edges("propose", nodes.route_after_propose)
builder.add_edge("evaluate", "select")
builder.add_edge("select", "plan")
builder.add_edge("register", END)


def compile_graph(checkpointer: BaseCheckpointSaver | None = None):
    return builder.compile(checkpointer=checkpointer)
