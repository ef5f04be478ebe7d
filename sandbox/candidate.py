"""A candidate kernel: a self-contained module's source plus where it came from."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, computed_field

from kernels import kit
from search_space.template import source_hash


class Candidate(BaseModel):
    problem: str
    source: str
    entry: str
    knobs: dict[str, Any] = Field(default_factory=dict)
    origin: Literal["template", "llm", "human", "library"] = "human"
    parent_id: str | None = None

    @computed_field  # type: ignore[prop-decorator]
    @property
    def id(self) -> str:
        """The source's hash, and where the source imports the kernel library's kit, the kit's
        too: the same text built on another kit is another candidate (its evaluations, cached
        by id, do not carry over)."""
        if kit.uses_kit(self.source):
            return source_hash(f"{self.source}\0kit {kit.kit_hash()}")
        return source_hash(self.source)
