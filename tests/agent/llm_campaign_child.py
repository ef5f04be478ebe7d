"""A campaign process for the kill-and-resume test: the real campaign with the quick backend
(evaluations slowed a little, so that the kill lands mid-run). argv: config JSON, home."""

from __future__ import annotations

import sys
from pathlib import Path

from quick_backend import QuickBackend

import agent.campaign
from agent.campaign import Campaigns
from agent.config import CampaignConfig

if __name__ == "__main__":
    config_path, home = sys.argv[1], sys.argv[2]
    backend = QuickBackend(delay_s=0.2)
    agent.campaign.make_backend = lambda *args, **kwargs: backend
    Campaigns(home).start(CampaignConfig.model_validate_json(Path(config_path).read_text()))
