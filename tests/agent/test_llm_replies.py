"""The proposal in replies as real servers and models send them (agent.llm.proposals.parse_proposal):
reasoning blocks with fences and braces of their own, prose with braces around the JSON, a
fence inside the kernel source, JSON that merely illustrates before the real answer, and the
source as a python block beside a JSON header. Each case: the reply, and what must come out."""

from __future__ import annotations

import pytest

from agent.llm.proposals import ProposalError, parse_proposal

SOURCE = 'import torch\n\n\ndef embedding_bag(weight, indices, offsets):\n    return {"a": 1}\n'
ESCAPED = SOURCE.replace("\n", "\\n").replace('"', '\\"')
KNOBS = '{"kind": "knobs", "knobs": {"BLOCK_B": 8}, "rationale": "bigger tiles"}'
EIGHT = ("knobs", {"BLOCK_B": 8})

REPLIES = {
    "bare": (KNOBS, EIGHT),
    "think-with-fences-and-json": (
        '<think>\nMaybe ```json\n{"kind": "knobs", "knobs": {"BLOCK_B": 2}}\n``` no, larger:'
        " {BLOCK_B} = 8 fits.\n</think>\n\n" + KNOBS,
        EIGHT,
    ),
    "unclosed-think-then-nothing": ("<think>let me see {", None),
    "closing-tag-only": (
        'so {"kind": "knobs", "knobs": {"BLOCK_B": 2}} or 8?</think>' + KNOBS,
        EIGHT,
    ),
    "braces-in-prose-before": (
        "The loop {for each bag} is slow; set {BLOCK_B: 8}.\n" + KNOBS,
        EIGHT,
    ),
    "trailing-prose-with-brace": (KNOBS + "\nHope this helps } good luck {", EIGHT),
    "fenced-json": ("Here:\n```json\n" + KNOBS + "\n```\nDone.", EIGHT),
    "fence-inside-source": (
        '{"kind": "module", "source": "# usage:\\n# ```python\\n# x\\n# ```\\n' + ESCAPED + '"}',
        ("module", "# usage:\n# ```python\n# x\n# ```\n" + SOURCE),
    ),
    "example-json-then-answer": (
        'A reply looks like {"kind": "knobs", "knobs": {}} in general; mine:\n' + KNOBS,
        EIGHT,
    ),
    "answer-then-unrelated-json": (KNOBS + '\nMetrics I expect: {"speedup": 1.3}', EIGHT),
    "source-as-python-fence": (
        '```json\n{"kind": "module", "rationale": "one pass"}\n```\n\n```python\n' + SOURCE + "```\n",
        ("module", SOURCE),
    ),
    "think-then-fenced-module": (
        "<think>\n```python\ndef draft(): pass\n```\n</think>\n"
        '{"kind": "module", "source": ""}\n```python\n' + SOURCE + "```",
        ("module", SOURCE),
    ),
    "prose-only": ("I would make the blocks bigger.", None),
}


@pytest.mark.parametrize("name", REPLIES)
def test_the_proposal_is_found_in_real_world_replies(name: str) -> None:
    text, expected = REPLIES[name]
    if expected is None:
        with pytest.raises(ProposalError):
            parse_proposal(text)
        return
    proposal = parse_proposal(text)
    kind, payload = expected
    assert proposal.kind == kind
    assert (proposal.knobs if kind == "knobs" else proposal.source) == payload


def test_the_error_names_what_the_proposal_got_wrong_not_an_illustration() -> None:
    text = 'Format: {"speedup": 2}. Answer: {"kind": "edit", "edits": []}'
    with pytest.raises(ProposalError, match=r"edit\.edits: List should have at least 1 item"):
        parse_proposal(text)


def test_the_response_schema_is_one_flat_object_structured_output_backends_accept() -> None:
    """vLLM's and SGLang's structured-output backends refuse a top-level oneOf without a type,
    $ref and discriminators: the schema is one object whose `kind` is an enum of every proposal
    kind, and every kind's example reply fits it."""
    import json

    import jsonschema

    from agent.llm.proposals import KINDS, proposal_schema

    schema = proposal_schema()
    text = json.dumps(schema)
    assert schema["type"] == "object" and schema["required"] == ["kind"]
    assert all(word not in text for word in ('"oneOf"', '"anyOf"', '"$ref"', '"discriminator"', '"$defs"'))
    assert schema["properties"]["kind"]["enum"] == list(KINDS)
    examples = {
        "knobs": {"kind": "knobs", "knobs": {"BLOCK_B": 8, "ACC_3D": True}},
        "module": {"kind": "module", "source": SOURCE},
        "edit": {"kind": "edit", "edits": [{"search": "a", "replace": "b"}], "rationale": "r"},
    }
    for kind, reply in examples.items():
        jsonschema.validate(reply, schema)  # what a constrained decoder may produce
        assert parse_proposal(json.dumps(reply)).kind == kind
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"kind": "rewrite"}, schema)


def test_a_broken_proposal_is_told_its_json_error_not_what_braces_inside_it_decode_as() -> None:
    # A raw quote inside the source ends the string early; the kernel's own dict literal decodes.
    text = '{"kind": "module", "source": "x = "a"\\nKNOBS = {"BLOCK": 4}\\n"}'
    with pytest.raises(ProposalError, match="not valid JSON"):
        parse_proposal(text)
