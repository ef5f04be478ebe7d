"""Kernels, replies and configs for the LLM proposer's tests."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

from llm_server import Reply, proposal

from agent.config import CampaignConfig, parse_config
from search_space.embedding_bag import TEMPLATE

REPO = Path(__file__).resolve().parents[2]
KEY_ENV = "RECFORGE_TEST_LLM_KEY"
KEY = "sk-test-4f8a1c0de5ec2e7"

# A module "written by the model": the template's kernel under another docstring, with the
# problem's entry point, so it is new source (a module, not a knob setting) that still keeps its
# knobs in KNOBS.
GOOD = TEMPLATE.render(TEMPLATE.defaults()).replace(
    "Pooled embedding-bag lookup: the library's hand-written default kernels.",
    "LLM-written variant of the pooled lookup.",
) + (
    '\n\ndef embedding_bag(weight, indices, offsets, *, mode="sum", per_sample_weights=None):\n'
    "    psw = per_sample_weights\n"
    "    return embedding_bag_forward(weight, indices, offsets, mode=mode, per_sample_weights=psw)\n"
)
assert GOOD.startswith('"""LLM-written')
# Fails at import, as a Triton compile error fails before anything runs.
BROKEN_LINE = "NUM_SMS = triton.cdiv(1)\n"
BROKEN = GOOD.replace("\nKNOBS = {", "\n" + BROKEN_LINE + "KNOBS = {")
STORE_GOOD = "acc_BD.to(out_ptr.dtype.element_ty)"
STORE_WRONG = "(acc_BD * 2).to(out_ptr.dtype.element_ty)"
WRONG = GOOD.replace(STORE_GOOD, STORE_WRONG)


def knob_settings() -> list[dict]:
    """Distinct valid knob settings other than the defaults, for proposals that never repeat."""
    out = []
    for block_b, block_l, warps in itertools.product((1, 2, 8, 16), (4, 16, 32), (1, 4)):
        knobs = {"BLOCK_B": block_b, "BLOCK_L": block_l, "num_warps": warps}
        try:
            TEMPLATE.validate(knobs)
        except ValueError:
            continue
        out.append(knobs)
    return out


def knob_replies(prompt_tokens: int = 100, completion_tokens: int = 20, delay_s: float = 0.0):
    """A policy step that answers each request with the next unused knob setting."""
    settings = iter(knob_settings())

    def step(request: dict) -> Reply:
        return Reply(
            proposal("knobs", knobs=next(settings)),
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            delay_s=delay_s,
        )

    return step


def config(tmp_path: Path, url: str, **sections) -> CampaignConfig:
    """A small LLM campaign on embedding_bag against `url`; `sections` update the defaults per
    section, e.g. llm={"max_retries": 0}, proposer={"kinds": ["llm", "search"]}."""
    raw: dict = {
        "name": "llm-test",
        "problems": ["embedding_bag"],
        "output_dir": str(tmp_path / "out"),
        "library": str(tmp_path / "library"),
        "proposer": {"kinds": ["llm"], "batch_size": 2, "seed": 1},
        "llm": {
            "base_url": url,
            "model": "scripted",
            "api_key_env": KEY_ENV,
            "timeout_s": 5,
            "max_retries": 2,
            "backoff_initial_s": 0.01,
            "backoff_max_s": 0.05,
            "format_retries": 1,
            "repair_depth": 2,
        },
        "budget": {"max_evaluations": 5, "max_wall_s": 600},
    }
    for section, values in sections.items():
        if isinstance(values, dict):
            raw[section] = {**raw.get(section, {}), **values}
        else:
            raw[section] = values
    return parse_config(raw)


def campaign_child(tmp_path: Path, cfg: CampaignConfig, home: Path, **env: str) -> subprocess.Popen:
    """A campaign on `cfg` in `home`, started in a process of its own (llm_campaign_child.py: the
    real campaign, the quick backend) and its own session; `env` adds to its environment. What
    it prints goes to tmp_path/child.log."""
    (tmp_path / "config.json").write_text(cfg.model_dump_json())
    with open(tmp_path / "child.log", "wb") as log:
        return subprocess.Popen(
            [
                sys.executable,
                str(REPO / "tests" / "agent" / "llm_campaign_child.py"),
                str(tmp_path / "config.json"),
                str(home),
            ],
            env={
                **os.environ,
                "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests" / "agent")]),
                "TRITON_INTERPRET": "1",
                **env,
            },
            cwd=tmp_path,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
