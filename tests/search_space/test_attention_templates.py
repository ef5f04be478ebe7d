"""The attention problems' search space: the library's forward under a tiling chosen by knobs,
rendered as a self-contained candidate that passes the screen and the sandbox."""

from __future__ import annotations

import pytest
import torch

from sandbox.candidate import Candidate
from sandbox.local import LocalBackend
from sandbox.result import Status
from sandbox.screen import screen_problem
from search_space import get_problem
from search_space.template import get_template

OPS = ("jagged_attention", "gdpa", "target_attention")


@pytest.mark.parametrize("op", OPS)
def test_rendered_template_is_a_screen_clean_module_with_the_tiling(op: str) -> None:
    template, problem = get_template(op), get_problem(op)
    assert problem.template == op
    source = template.render({"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2})
    assert screen_problem(source, problem.entry, problem) == []
    assert '"block_m": 64, "block_n": 32, "num_warps": 4, "num_stages": 2' in source
    assert source != template.render(template.defaults())


def test_tilings_that_cannot_fit_are_refused() -> None:
    template = get_template("jagged_attention")
    with pytest.raises(ValueError, match="16384 > 8192 scores per step spill with 4 warps"):
        template.render({"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 4})
    assert '"block_n": 128, "num_warps": 8' in template.render(
        {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8}
    )
    with pytest.raises(ValueError, match="not one of"):
        template.render({"BLOCK_M": 48})


@pytest.mark.slow
def test_sandbox_accepts_the_default_tiling(tmp_path) -> None:
    """Target attention (the quickest of the three interpreted): every check shape, bf16 and
    fp32, with the NaN-poisoned allocator and the no-op proof."""
    template = get_template("target_attention")
    candidate = Candidate(
        problem="target_attention",
        source=template.render(template.defaults()),
        entry=template.entry,
        origin="template",
    )
    result = LocalBackend(scratch_root=tmp_path).evaluate(candidate, timing=False)
    assert result.status == Status.OK, result.message
    assert {c.dtype for c in result.checks} >= {"bf16", "fp32"}


def test_a_bf16_bias_table_reads_as_its_values(device: torch.device) -> None:
    """A model may keep its relative bias in bf16; the kernels read it as fp32 values."""
    from kernels.attention import jagged_attention_forward
    from search_space.attention import jagged_attention_reference

    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(40, 2, 16, generator=gen, device=device).bfloat16() for _ in range(3))
    offsets = torch.tensor([0, 17, 40], device=device)
    bias = torch.randn(2, 8, generator=gen, device=device).bfloat16()
    out = jagged_attention_forward(q, k, v, offsets, max_seq_len=23, rel_bias=bias)
    want = jagged_attention_reference(
        q.float(), k.float(), v.float(), offsets, max_seq_len=23, rel_bias=bias.float()
    )
    torch.testing.assert_close(out.float(), want, atol=3e-2, rtol=3e-2)


def test_campaigns_time_attention_against_the_padded_baseline_only() -> None:
    """The loop reference takes minutes at the timing shapes; embedding bags keep every baseline."""
    from sandbox.protocol import all_baselines, campaign_baselines

    for op in OPS:
        assert campaign_baselines(get_problem(op)) == ["torch.padded"]
    embedding = get_problem("embedding_bag")
    assert campaign_baselines(embedding) == all_baselines(embedding)


# Appended to the rendered template: its output, with lse one part in a thousand high.
SKEWED_LSE = """


@triton.jit
def _skew_kernel(x_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n)
    tl.store(x_ptr + i, x * 1.001, mask=i < n)


def skewed(*args, return_lse=False, **kwargs):
    got = target_attention(*args, return_lse=return_lse, **kwargs)
    if return_lse and got[1].numel():
        _skew_kernel[(triton.cdiv(got[1].numel(), 256),)](got[1], got[1].numel(), BLOCK=256)
    return got
"""


@pytest.mark.slow
def test_sandbox_checks_the_statistics_a_forward_returns(tmp_path) -> None:
    """The training contract is checked like the output: an lse 0.1% off is a wrong kernel
    though every output is right."""
    template = get_template("target_attention")
    candidate = Candidate(
        problem="target_attention",
        source=template.render(template.defaults()) + SKEWED_LSE,
        entry="skewed",
        origin="template",
    )
    result = LocalBackend(scratch_root=tmp_path).evaluate(candidate, timing=False, trials=1)
    assert result.status == Status.WRONG, result.message
    assert "output 1:" in result.message and "with_lse=True" in result.message


def test_every_starting_source_fits_the_prompts_bound() -> None:
    """What a proposal starts from (each problem's template, rendered) is at most
    PROMPT_SOURCE_BOUND characters: the attention candidates hold their forward or backward
    kernels and import the rest from the kit."""
    from search_space import problem_names
    from search_space.template import PROMPT_SOURCE_BOUND, get_template

    sizes = {}
    for name in problem_names():
        try:
            template = get_template(name)
        except ValueError:  # a problem searched by proposals alone
            continue
        sizes[name] = len(template.render(template.defaults()))
    assert {"jagged_attention", "jagged_attention_grad", "gdpa", "target_attention_grad"} <= set(sizes)
    assert max(sizes.values()) <= PROMPT_SOURCE_BOUND, sizes
