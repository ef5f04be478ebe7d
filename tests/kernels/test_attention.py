"""The attention family's default kernels (kernels.attention: the kit's forward and
kernels/attention/backward.py) and the recforge::jagged_attention, recforge::gdpa and
recforge::target_attention ops, forward and every gradient, against autograd of
search_space.attention's references computed in fp64 on the same inputs.

On a CPU the kernels run in the Triton interpreter with 16 x 16 tiles, so the short sequences
here (0, 1, 5, 17 and 40 tokens) cover empty and single-token sequences, partial tiles, and
query blocks that see unmasked, boundary and diagonal key tiles.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernels import attention as attn
from kernels import ops
from kernels.kit import attention as kit
from kernels.registry import DISPATCHER
from sandbox.protocol import compare
from search_space import attention as reference
from search_space.problem import Tolerance

# Errors against fp64 on the same inputs. fp32: exact (ieee) products, so only summation order
# differs (measured around 3e-7 relative). bf16: p and ds are rounded to bf16 for the tensor-core
# products and the outputs once more; in the interpreter every fp32 -> bf16 conversion truncates
# instead of rounding to nearest, which biases those errors and about doubles them (measured
# norm errors 4e-3 to 7e-3, the worst element at 7e-2 of the RMS, in gradients).
TOLERANCES = {
    "fp32": Tolerance(atol=1e-4, rtol=1e-4, norm_rtol=2e-5),
    "bf16": Tolerance(atol=1e-1, rtol=5e-2, norm_rtol=1.5e-2),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
HEADS, DIM = 2, 16
LENGTHS = [0, 1, 5, 17, 40]
# Targets per sequence of LENGTHS: 2 of none, the one token, 2 of 5, 20 of 17 (all of them: the
# count is clamped), 3 of 40.
NUM_TARGETS = [2, 1, 2, 20, 3]
NUM_BUCKETS = 8  # distances from 12 on share the last bucket


def assert_close(
    got: torch.Tensor, want64: torch.Tensor, dtype: str, what: str, scale: float | None = None
) -> None:
    ok, details = compare(got.detach().double(), want64.detach(), TOLERANCES[dtype], scale)
    assert ok, (
        f"{what}: {details['message']} (max abs err {details.get('max_abs_err', 0):.3g}, "
        f"relative error norm {details.get('norm_rel_err', 0):.3g})"
    )


def _offsets(lengths: list[int], device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.tensor(
        [0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], dtype=dtype, device=device
    )


def _randn(shape: tuple, dtype: str, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    return torch.randn(shape, generator=gen, device=device).to(DTYPES[dtype])


def check_against_reference(
    op: Callable[..., torch.Tensor],
    ref: Callable[..., torch.Tensor],
    inputs: dict[str, torch.Tensor | None],
    dtype: str,
    what: str,
    seed: int = 1,
) -> None:
    """op(**inputs) and the gradient of every floating-point input vs autograd of ref on fp64
    copies, each side on its own leaf tensors."""
    floats = [n for n, t in inputs.items() if t is not None and t.is_floating_point()]
    leaves = {n: (t.clone().requires_grad_() if n in floats else t) for n, t in inputs.items()}
    out = op(**leaves)
    gen = torch.Generator(device=out.device).manual_seed(seed)
    grad_out = torch.randn(out.shape, generator=gen, device=out.device).to(out.dtype)
    out.backward(grad_out)

    leaves64 = {n: (t.detach().double().requires_grad_() if n in floats else t) for n, t in inputs.items()}
    out64 = ref(**leaves64)
    if out64.requires_grad:  # else nothing attends to anything: every gradient is zero
        out64.backward(grad_out.double())

    assert out.dtype == next(t for t in inputs.values() if t is not None).dtype
    assert_close(out, out64, dtype, f"{what}: out")
    # A gradient that is exactly zero (dq of a row with one key) is held to a hundredth of
    # grad_out's RMS, as the gradient problems do, not to its own zero RMS.
    grad_scale = 0.01 * grad_out.double().pow(2).mean().sqrt().item() if grad_out.numel() else None
    for name in floats:
        grad, grad64 = leaves[name].grad, leaves64[name].grad
        assert grad is not None and grad.dtype == inputs[name].dtype, name
        assert_close(
            grad,
            torch.zeros_like(leaves64[name]) if grad64 is None else grad64,
            dtype,
            f"{what}: d{name}",
            grad_scale,
        )


# --- jagged_attention -----------------------------------------------------------------------


def _jagged_inputs(
    device: torch.device,
    dtype: str = "fp32",
    *,
    lengths: list[int] = LENGTHS,
    targets: list[int] | None = None,
    bias: bool = False,
    index_dtype: torch.dtype = torch.int64,
    seed: int = 0,
    heads: int = HEADS,
    dim: int = DIM,
    num_buckets: int = NUM_BUCKETS,
) -> dict:
    gen = torch.Generator(device=device).manual_seed(seed)
    total = sum(lengths)
    q, k, v = (_randn((total, heads, dim), dtype, gen, device) for _ in range(3))
    return {
        "q": q,
        "k": k,
        "v": v,
        "offsets": _offsets(lengths, device, index_dtype),
        "num_targets": None if targets is None else torch.tensor(targets, device=device, dtype=index_dtype),
        "rel_bias": torch.randn((heads, num_buckets), generator=gen, device=device) if bias else None,
    }


def _jagged(fn: Callable, **options) -> Callable[..., torch.Tensor]:
    def call(q, k, v, offsets, num_targets, rel_bias):
        return fn(q, k, v, offsets, num_targets=num_targets, rel_bias=rel_bias, **options)

    return call


@pytest.mark.parametrize("activation", ["softmax", "silu"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("targets", [False, True], ids=["no-targets", "targets"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "rel-bias"])
def test_jagged_attention(
    activation: str, causal: bool, targets: bool, bias: bool, device: torch.device, empty_library
) -> None:
    inputs = _jagged_inputs(device, targets=NUM_TARGETS if targets else None, bias=bias)
    options = {"max_seq_len": max(LENGTHS), "activation": activation, "causal": causal}
    check_against_reference(
        _jagged(ops.jagged_attention, **options),
        _jagged(reference.jagged_attention_reference, **options),
        inputs,
        "fp32",
        f"jagged_attention {options}, targets={targets}, bias={bias}",
    )
    assert DISPATCHER.last["jagged_attention"] == "default"


@pytest.mark.parametrize(
    "activation, causal",
    [("softmax", True), ("silu", False)],
)
def test_jagged_attention_bf16(activation: str, causal: bool, device: torch.device, empty_library) -> None:
    inputs = _jagged_inputs(device, "bf16", targets=NUM_TARGETS, bias=True)
    options = {"max_seq_len": max(LENGTHS), "activation": activation, "causal": causal}
    check_against_reference(
        _jagged(ops.jagged_attention, **options),
        _jagged(reference.jagged_attention_reference, **options),
        inputs,
        "bf16",
        f"bf16 jagged_attention {options}",
    )


def _jagged_launchers(options: dict, **launch) -> Callable[..., torch.Tensor]:
    """The forward and backward launchers called directly (not through the ops), with `launch`
    options: block_m and block_n (the forward's and dQ's tiles; the dK/dV kernel gets them the
    other way round)."""
    block_m, block_n = launch.pop("block_m", None), launch.pop("block_n", None)

    class Launchers(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, rel_bias, offsets, num_targets):
            out, lse = attn.jagged_attention_forward(
                q, k, v, offsets, num_targets=num_targets, rel_bias=rel_bias, return_lse=True,
                block_m=block_m, block_n=block_n, **options, **launch,
            )  # fmt: skip
            ctx.save_for_backward(q, k, v, rel_bias, offsets, num_targets, out, lse)
            return out

        @staticmethod
        def backward(ctx, grad_out):
            q, k, v, rel_bias, offsets, num_targets, out, lse = ctx.saved_tensors
            dq, dk, dv, d_rel_bias = attn.jagged_attention_backward(
                grad_out, q, k, v, offsets, out, lse, num_targets=num_targets, rel_bias=rel_bias,
                block_m=block_n, block_n=block_m, dq_block_m=block_m, dq_block_n=block_n,
                **options, **launch,
            )  # fmt: skip
            return dq, dk, dv, d_rel_bias, None, None

    return lambda q, k, v, offsets, num_targets, rel_bias: Launchers.apply(
        q, k, v, rel_bias, offsets, num_targets
    )


def test_silu_tanh_form_at_fp32_precision(device: torch.device) -> None:
    # bf16 and fp16 silu default to h (1 + tanh h), h = s / 2 (tanh.approx on a GPU, from exp
    # here): forced on fp32 inputs, its algebra (the halved score and bias scales, the gradient
    # from one tanh) is held to the fp32 tolerance, with targets and a bias.
    inputs = _jagged_inputs(device, targets=NUM_TARGETS, bias=True)
    options = {"max_seq_len": max(LENGTHS), "activation": "silu", "causal": True}
    check_against_reference(
        _jagged_launchers(options, fast_silu=True),
        _jagged(reference.jagged_attention_reference, **options),
        inputs,
        "fp32",
        "silu in its tanh form",
    )


def test_tma_loads_need_a_hopper_gpu(device: torch.device) -> None:
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9:
        pytest.skip("this GPU has TMA (test_tma_forward_equals_pointer_loads_on_gpu covers it)")
    inputs = _jagged_inputs(device)
    with pytest.raises(ValueError, match="TMA loads need a CUDA GPU of compute capability 9.0"):
        attn.jagged_attention_forward(
            inputs["q"], inputs["k"], inputs["v"], inputs["offsets"], max_seq_len=max(LENGTHS), tma=True
        )


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("sign", [1, -1], ids=["scale-folded", "negative-scale"])
def test_softmax_rescale_with_growing_scores(causal: bool, sign: int, device: torch.device) -> None:
    # Keys whose scores grow along the sequence by about 2.5 (base e) per token, so every row's
    # running max moves on at every 16-key tile. A positive scale is folded into the
    # exponent's multiply-add; -q with a negative scale gives the same scores the other way.
    # Output and lse (base 2) against fp64.
    lengths = [0, 1, 17, 40, 33]
    inputs = _jagged_inputs(device, lengths=lengths, targets=[0, 1, 2, 3, 0])
    q, k, v, offsets = inputs["q"].abs(), inputs["k"], inputs["v"], inputs["offsets"]
    growth = torch.cat([torch.arange(n, dtype=torch.float32, device=device) for n in lengths])
    k = k.abs() * (1 + growth)[:, None, None]
    options = {"max_seq_len": max(lengths), "causal": causal, "num_targets": inputs["num_targets"]}
    scale = DIM**-0.5
    out, lse = attn.jagged_attention_forward(
        sign * q, k, v, offsets, **options, scale=sign * scale, return_lse=True
    )
    want = reference.jagged_attention_reference(q.double(), k.double(), v.double(), offsets, **options)
    assert_close(out, want, "fp32", "out")
    scores = torch.einsum("thd,shd->hts", q.double(), k.double()) * scale
    want_lse = torch.empty_like(lse, dtype=torch.float64)
    bounds = offsets.tolist()
    for b, (start, end) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        n = end - start
        allowed = reference.allowed_mask(n, n - min(int(inputs["num_targets"][b]), n), causal, q.device)
        s = scores[:, start:end, start:end].masked_fill(~allowed, float("-inf"))
        want_lse[:, start:end] = torch.logsumexp(s, dim=-1) / math.log(2)
    assert torch.allclose(lse.double(), want_lse, rtol=1e-5, atol=1e-4)


def test_silu_form_defaults() -> None:
    cpu, bf16 = torch.zeros(1), torch.zeros(1, dtype=torch.bfloat16)
    assert kit._silu_form(bf16, "silu", None) == "tanh"
    assert kit._silu_form(cpu, "silu", None) == "sigmoid"
    assert kit._silu_form(cpu, "silu", True) == "tanh"
    assert kit._silu_form(bf16, "silu", False) == "sigmoid"
    assert kit._silu_form(bf16, "gelu", True) == "sigmoid"


@pytest.mark.parametrize("blocks", [(32, 16), (16, 32), (64, 16)], ids=lambda b: f"{b[0]}x{b[1]}")
def test_jagged_attention_tile_shapes(blocks: tuple[int, int], device: torch.device) -> None:
    """Query and key tiles of different sizes (the search will try them): the key ranges, the
    diagonal skew of the bias gradient and the masks must not assume square tiles."""
    block_m, block_n = blocks
    lengths, targets = [70, 17, 0, 33], [3, 17, 0, 40]
    inputs = _jagged_inputs(device, lengths=lengths, targets=targets, bias=True)
    options = {"max_seq_len": 70, "activation": "softmax", "causal": True}
    check_against_reference(
        _jagged_launchers(options, block_m=block_m, block_n=block_n),
        _jagged(reference.jagged_attention_reference, **options),
        inputs,
        "fp32",
        f"jagged_attention with {block_m} x {block_n} tiles",
    )


@pytest.mark.parametrize("blocks", [(16, 16), (32, 16), (16, 32), (64, 16)], ids=lambda b: f"{b[0]}x{b[1]}")
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_shifted_last_key_tile_with_tile_shapes(blocks: tuple[int, int], causal: bool, device) -> None:
    """The last key tile shifted into the pipelined loop (forced here: by default it needs TMA
    loads) with query and key tiles of different sizes: the overlap with the tile before and the
    causal diagonal are masked in whichever tiles they fall, with the relative bias."""
    block_m, block_n = blocks
    lengths = [70, 17, 0, 33, 16, 5]
    t = _jagged_inputs(device, lengths=lengths, bias=True)
    options = {"max_seq_len": max(lengths), "causal": causal, "rel_bias": t["rel_bias"]}
    args = (t["q"], t["k"], t["v"], t["offsets"])
    out = attn.jagged_attention_forward(*args, **options, block_m=block_m, block_n=block_n, shift_last=True)
    want = reference.jagged_attention_reference(*(x.double() for x in args[:3]), t["offsets"], **options)
    assert_close(out, want, "fp32", f"shifted last tile, {block_m} x {block_n}, causal={causal}")


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.slow
def test_jagged_attention_far_bias(causal: bool, device: torch.device) -> None:
    """Tiles far from the diagonal take the bias of at most two buckets without a per-score
    bucket (forward and bias gradient, below and, without the causal mask, above the diagonal);
    32 buckets over 100 positions put such tiles on both sides of bucket edges (48, 64, 96)."""
    lengths, targets = [61, 100, 0, 17], [2, 5, 0, 1]
    inputs = _jagged_inputs(device, lengths=lengths, targets=targets, bias=True, num_buckets=32)
    options = {"max_seq_len": 100, "activation": "softmax", "causal": causal}
    check_against_reference(
        _jagged_launchers(options),
        _jagged(reference.jagged_attention_reference, **options),
        inputs,
        "fp32",
        f"jagged_attention, 32 buckets, causal={causal}",
    )


@pytest.mark.parametrize("path", ["ranks", "torch"])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_group_by_request(path: str, index_dtype: torch.dtype, device: torch.device, monkeypatch) -> None:
    # 40 candidates over 7 requests, two of them without candidates, out of order.
    if path == "torch":  # the fallback for more candidates than the rank sort takes
        monkeypatch.setattr(kit, "RANK_SORT_MAX", 0)
    gen = torch.Generator(device=device).manual_seed(3)
    requests = torch.tensor([0, 2, 3, 5, 6], device=device)[
        torch.randint(0, 5, (40,), generator=gen, device=device)
    ]
    seeds = 3
    q_offsets, order = kit._group_by_request(requests.to(index_dtype), 7, seeds)
    assert torch.equal(order, torch.argsort(requests, stable=True))
    counts = torch.bincount(requests, minlength=7)
    assert q_offsets.tolist() == [0, *torch.cumsum(counts * seeds, 0).tolist()]


# --- gdpa -----------------------------------------------------------------------------------

Q_LENGTHS = [3, 0, 17, 40, 1]
KV_LENGTHS = [5, 7, 0, 33, 1]  # a sequence with queries and no keys, one with keys and no queries
NUM_SEEDS = 5


def _gdpa_inputs(
    device: torch.device,
    dtype: str = "fp32",
    *,
    broadcast_q: bool = False,
    q_lengths: list[int] = Q_LENGTHS,
    kv_lengths: list[int] = KV_LENGTHS,
    num_seeds: int = NUM_SEEDS,
    index_dtype: torch.dtype = torch.int64,
    seed: int = 0,
    heads: int = HEADS,
    dim: int = DIM,
) -> dict:
    gen = torch.Generator(device=device).manual_seed(seed)
    q_rows = num_seeds if broadcast_q else sum(q_lengths)
    return {
        "q": _randn((q_rows, heads, dim), dtype, gen, device),
        "k": _randn((sum(kv_lengths), heads, dim), dtype, gen, device),
        "v": _randn((sum(kv_lengths), heads, dim), dtype, gen, device),
        "q_offsets": None if broadcast_q else _offsets(q_lengths, device, index_dtype),
        "kv_offsets": _offsets(kv_lengths, device, index_dtype),
    }


def _gdpa(fn: Callable, **options) -> Callable[..., torch.Tensor]:
    return lambda q, k, v, q_offsets, kv_offsets: fn(q, k, v, q_offsets, kv_offsets, **options)


@pytest.mark.parametrize("activation", ["gelu", "silu", "relu", "none"])
@pytest.mark.parametrize("broadcast_q", [False, True], ids=["jagged-q", "broadcast-q"])
def test_gdpa(activation: str, broadcast_q: bool, device: torch.device, empty_library) -> None:
    inputs = _gdpa_inputs(device, broadcast_q=broadcast_q)
    options = {"activation": activation, "broadcast_q": broadcast_q}
    check_against_reference(
        _gdpa(ops.gdpa, **options),
        _gdpa(reference.gdpa_reference, **options),
        inputs,
        "fp32",
        f"gdpa {options}",
    )
    assert DISPATCHER.last["gdpa"] == "default"


@pytest.mark.parametrize("activation, broadcast_q", [("gelu", False), ("silu", True)])
def test_gdpa_bf16(activation: str, broadcast_q: bool, device: torch.device, empty_library) -> None:
    inputs = _gdpa_inputs(device, "bf16", broadcast_q=broadcast_q)
    options = {"activation": activation, "broadcast_q": broadcast_q}
    check_against_reference(
        _gdpa(ops.gdpa, **options),
        _gdpa(reference.gdpa_reference, **options),
        inputs,
        "bf16",
        f"bf16 gdpa {options}",
    )


@pytest.mark.parametrize("broadcast_q", [False, True], ids=["jagged-q", "broadcast-q"])
@pytest.mark.parametrize("slack", [0, 7], ids=["tight-bounds", "loose-bounds"])
def test_gdpa_with_bounds(
    broadcast_q: bool, slack: int, device: torch.device, empty_library, monkeypatch
) -> None:
    # max_kv_len (and max_q_len for jagged queries) instead of the host sync, which would raise
    # here: the same output and gradients, with bounds at the longest sequences or above them.
    def synced(*args):
        raise AssertionError("gdpa with bounds measured the sequences on the host")

    monkeypatch.setattr(kit, "_cross_lengths", synced)
    inputs = _gdpa_inputs(device, broadcast_q=broadcast_q)
    bounds = {"max_kv_len": max(KV_LENGTHS) + slack}
    if not broadcast_q:
        bounds["max_q_len"] = max(Q_LENGTHS) + slack
    options = {"activation": "silu", "broadcast_q": broadcast_q}
    check_against_reference(
        _gdpa(ops.gdpa, **options, **bounds),
        _gdpa(reference.gdpa_reference, **options),
        inputs,
        "fp32",
        f"gdpa {options} {bounds}",
    )
    assert DISPATCHER.last["gdpa"] == "default"


# --- the last key tile, for every op ---------------------------------------------------------

POISON_LENGTHS = [40, 17, 33, 16, 5]  # 16-key tiles in the interpreter: ragged, whole, short
POISONED = 2


def _poisoned_case(
    op: str, device: torch.device, shift_last: bool
) -> tuple[Callable, Callable, dict, torch.Tensor]:
    """(kernel(**inputs), reference(**inputs), inputs, rows to compare) for one op, the keys and
    values of sequence (request) POISONED set to inf and NaN. The compared rows are the others'."""
    if op.startswith("jagged"):
        causal = op == "jagged-causal-silu-bias"
        inputs = _jagged_inputs(device, lengths=POISON_LENGTHS, bias=causal)
        options = {"max_seq_len": max(POISON_LENGTHS), "causal": causal}
        if causal:
            options["activation"] = "silu"
        seq_of_row = torch.repeat_interleave(torch.arange(len(POISON_LENGTHS)), torch.tensor(POISON_LENGTHS))
        kernel = _jagged(attn.jagged_attention_forward, **options, shift_last=shift_last)
        ref = _jagged(reference.jagged_attention_reference, **options)
    elif op == "gdpa":
        q_lengths = [3, 20, 7, 1, 18]
        inputs = _gdpa_inputs(device, q_lengths=q_lengths, kv_lengths=POISON_LENGTHS)
        seq_of_row = torch.repeat_interleave(torch.arange(len(q_lengths)), torch.tensor(q_lengths))
        kernel = _gdpa(attn.gdpa_forward, activation="gelu", shift_last=shift_last)
        ref = _gdpa(reference.gdpa_reference, activation="gelu")
    else:
        requests = [2, 0, 3, 2, 1, 4, 0]
        inputs = _target_inputs(device, cand_to_request=requests, kv_lengths=POISON_LENGTHS)
        seq_of_row = torch.tensor(requests)
        kernel = _target(attn.target_attention_forward, activation="softmax", shift_last=shift_last)
        ref = _target(reference.target_attention_reference, activation="softmax")
    offsets = _offsets(POISON_LENGTHS, device)
    rows = slice(int(offsets[POISONED]), int(offsets[POISONED + 1]))
    inputs["k"][rows] = float("inf")
    inputs["v"][rows] = float("nan")
    return kernel, ref, inputs, (seq_of_row != POISONED).to(device)


@pytest.mark.parametrize("shift_last", [True, False], ids=["shifted-last-tile", "masked-last-tile"])
@pytest.mark.parametrize("op", ["jagged", "jagged-causal-silu-bias", "gdpa", "target"])
def test_last_key_tile_reads_nothing_of_the_next_sequence(op: str, shift_last: bool, device) -> None:
    # Without targets, a sequence's last key tile with shift_last ends at its last key in the
    # pipelined loop, overlapping the tile before, whose keys it masks out with the causal mask;
    # else a masked loop after the pipelined one reads past the end and zeroes what it read.
    # Either way the next sequence's keys and values must not reach the output: with inf keys
    # and NaN values in one sequence, every other sequence's rows match fp64.
    kernel, ref, inputs, keep = _poisoned_case(op, device, shift_last)
    out = kernel(**inputs)
    want = ref(**{n: t.double() if t is not None and t.is_floating_point() else t for n, t in inputs.items()})
    assert_close(out[keep], want[keep], "fp32", f"{op}, shift_last={shift_last}")
    assert out[~keep].isnan().any(), "the poisoned sequence's own rows see its NaN values"


# --- target_attention -----------------------------------------------------------------------

REQUEST_LENGTHS = [5, 0, 33, 1, 9]  # request 1 has an empty history, request 4 no candidate
CAND_TO_REQUEST = [2, 0, 3, 2, 1, 0, 2]
NUM_CAND_SEEDS = 3


def _target_inputs(
    device: torch.device,
    dtype: str = "fp32",
    *,
    cand_to_request: list[int] = CAND_TO_REQUEST,
    kv_lengths: list[int] = REQUEST_LENGTHS,
    seeds: int = NUM_CAND_SEEDS,
    index_dtype: torch.dtype = torch.int64,
    seed: int = 0,
    heads: int = HEADS,
    dim: int = DIM,
) -> dict:
    gen = torch.Generator(device=device).manual_seed(seed)
    return {
        "q_cand": _randn((len(cand_to_request), seeds, heads, dim), dtype, gen, device),
        "k": _randn((sum(kv_lengths), heads, dim), dtype, gen, device),
        "v": _randn((sum(kv_lengths), heads, dim), dtype, gen, device),
        "kv_offsets": _offsets(kv_lengths, device, index_dtype),
        "cand_to_request": torch.tensor(cand_to_request, device=device, dtype=index_dtype),
    }


def _target(fn: Callable, **options) -> Callable[..., torch.Tensor]:
    return lambda q_cand, k, v, kv_offsets, cand_to_request: fn(
        q_cand, k, v, kv_offsets, cand_to_request, **options
    )


@pytest.mark.parametrize("activation", ["softmax", "silu"])
@pytest.mark.parametrize("order", ["sorted", "unsorted"])
def test_target_attention(activation: str, order: str, device: torch.device, empty_library) -> None:
    requests = sorted(CAND_TO_REQUEST) if order == "sorted" else CAND_TO_REQUEST
    inputs = _target_inputs(device, cand_to_request=requests)
    options = {"activation": activation}
    check_against_reference(
        _target(ops.target_attention, **options),
        _target(reference.target_attention_reference, **options),
        inputs,
        "fp32",
        f"target_attention {options}, {order} candidates",
    )
    assert DISPATCHER.last["target_attention"] == "default"


@pytest.mark.parametrize("activation", ["softmax", "silu"])
def test_target_attention_bf16(activation: str, device: torch.device, empty_library) -> None:
    inputs = _target_inputs(device, "bf16")
    options = {"activation": activation}
    check_against_reference(
        _target(ops.target_attention, **options),
        _target(reference.target_attention_reference, **options),
        inputs,
        "bf16",
        f"bf16 target_attention {options}",
    )


@pytest.mark.parametrize("activation", ["softmax", "silu"])
def test_target_attention_with_bounds(activation: str, device: torch.device, empty_library) -> None:
    # Unsorted candidates, loose bounds (3 candidates at most per request, histories up to 33):
    # the sync-free path groups by argsort and sizes the grid from the bounds.
    options = {"activation": activation, "max_candidates": 5, "max_history": 40}
    check_against_reference(
        _target(ops.target_attention, **options),
        _target(reference.target_attention_reference, activation=activation),
        _target_inputs(device),
        "fp32",
        f"target_attention {options}",
    )


def test_target_attention_rejects_bad_bounds(device: torch.device) -> None:
    t = _target_inputs(device)
    args = (t["q_cand"], t["k"], t["v"], t["kv_offsets"], t["cand_to_request"])
    with pytest.raises(ValueError, match="max_candidates and max_history go together"):
        ops.target_attention(*args, max_candidates=3)
    with pytest.raises(ValueError, match="max_history must be an int >= 0, got -1"):
        ops.target_attention(*args, max_candidates=3, max_history=-1)
    with pytest.raises(ValueError, match="max_candidates must be an int >= 0, got 2.5"):
        attn.target_attention_backward(
            t["q_cand"], *args, t["q_cand"], None, max_candidates=2.5, max_history=3
        )


# --- shared edge cases ----------------------------------------------------------------------


@pytest.mark.slow
def test_int32_offsets(device: torch.device, empty_library) -> None:
    """int32 offsets, num_targets and cand_to_request, through every op."""
    options = {"max_seq_len": max(LENGTHS), "activation": "softmax", "causal": True}
    check_against_reference(
        _jagged(ops.jagged_attention, **options),
        _jagged(reference.jagged_attention_reference, **options),
        _jagged_inputs(device, targets=NUM_TARGETS, bias=True, index_dtype=torch.int32),
        "fp32",
        "jagged_attention, int32 offsets",
    )
    check_against_reference(
        _gdpa(ops.gdpa, activation="gelu"),
        _gdpa(reference.gdpa_reference, activation="gelu"),
        _gdpa_inputs(device, index_dtype=torch.int32),
        "fp32",
        "gdpa, int32 offsets",
    )
    check_against_reference(
        _target(ops.target_attention, activation="softmax"),
        _target(reference.target_attention_reference, activation="softmax"),
        _target_inputs(device, index_dtype=torch.int32),
        "fp32",
        "target_attention, int32 offsets",
    )


def test_empty_inputs(device: torch.device, empty_library) -> None:
    """No sequences, only empty sequences, no candidates: zeros (or nothing) and zero grads."""
    cases = [
        (_jagged(ops.jagged_attention, max_seq_len=0), _jagged_inputs(device, lengths=[])),
        (_jagged(ops.jagged_attention, max_seq_len=0), _jagged_inputs(device, lengths=[0, 0])),
        (_gdpa(ops.gdpa), _gdpa_inputs(device, q_lengths=[], kv_lengths=[])),
        (_gdpa(ops.gdpa), _gdpa_inputs(device, q_lengths=[0, 4], kv_lengths=[3, 0])),
        (_gdpa(ops.gdpa, broadcast_q=True), _gdpa_inputs(device, broadcast_q=True, kv_lengths=[0, 0])),
        (_target(ops.target_attention), _target_inputs(device, cand_to_request=[])),
        (_target(ops.target_attention), _target_inputs(device, cand_to_request=[0, 1], kv_lengths=[0, 0])),
    ]
    for op, inputs in cases:
        leaves = {
            n: (t.clone().requires_grad_() if t is not None and t.is_floating_point() else t)
            for n, t in inputs.items()
        }
        out = op(**leaves)
        assert torch.equal(out, torch.zeros_like(out))
        out.sum().backward()
        for t in leaves.values():
            if t is not None and t.is_floating_point():
                assert torch.equal(t.grad, torch.zeros_like(t))


@triton.jit
def _bucket_kernel(
    dist_ptr, out_ptr, n, NUM_BUCKETS: tl.constexpr, LOG2_EXACT: tl.constexpr, BLOCK: tl.constexpr
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    dist = tl.load(dist_ptr + offs, mask=offs < n, other=0)
    tl.store(out_ptr + offs, kit._relative_bucket(dist, NUM_BUCKETS, LOG2_EXACT), mask=offs < n)


@triton.jit
def _bucket_start_kernel(out_ptr, NUM_BUCKETS: tl.constexpr, LOG2_EXACT: tl.constexpr):
    buckets = tl.arange(0, NUM_BUCKETS)
    tl.store(out_ptr + buckets, kit._bucket_start(buckets, NUM_BUCKETS, LOG2_EXACT))


@pytest.mark.parametrize("num_buckets", [2, 8, 64])
def test_relative_bucket_in_kernel_is_exact(num_buckets: int, device: torch.device) -> None:
    """The kernels' bucket (float32 exponent and mantissa bits) equals the reference's at every
    octave boundary and half-octave, up to the 2^24 where float32 stops being exact."""
    edges = [0, 1, 2, 3]
    for e in range(2, 24):
        for d in (2**e, 3 * 2 ** (e - 1)):
            edges += [d - 1, d, d + 1]
    dist = torch.tensor(sorted(set(edges)) + list(range(4096)), dtype=torch.int32, device=device)
    out = torch.empty_like(dist)
    exact = num_buckets // 2
    _bucket_kernel[(triton.cdiv(dist.numel(), 1024),)](
        dist, out, dist.numel(), NUM_BUCKETS=num_buckets, LOG2_EXACT=exact.bit_length() - 1, BLOCK=1024
    )
    want = reference.relative_bucket(dist.long(), num_buckets).to(torch.int32)
    bad = (out != want).nonzero().flatten()
    assert bad.numel() == 0, (
        f"distance {dist[bad[0]].item()}: kernel {out[bad[0]].item()}, reference {want[bad[0]].item()}"
    )

    # The first distance of every bucket, which the two-bucket tiles split at.
    starts = torch.empty(num_buckets, dtype=torch.int32, device=device)
    _bucket_start_kernel[(1,)](starts, NUM_BUCKETS=num_buckets, LOG2_EXACT=exact.bit_length() - 1)
    first = [int((want == b).nonzero()[0]) for b in range(num_buckets)]
    assert starts.tolist() == [dist[i].item() for i in first]


# --- torch.compile and the fallback ---------------------------------------------------------

OP_CASES = {
    "jagged_attention": (
        lambda device: _jagged_inputs(device, targets=NUM_TARGETS, bias=True),
        lambda **kw: _jagged(ops.jagged_attention, max_seq_len=max(LENGTHS))(**kw),
        lambda **kw: _jagged(reference.jagged_attention_reference, max_seq_len=max(LENGTHS))(**kw),
    ),
    "gdpa": (
        lambda device: _gdpa_inputs(device, broadcast_q=True),
        lambda **kw: _gdpa(ops.gdpa, broadcast_q=True)(**kw),
        lambda **kw: _gdpa(reference.gdpa_reference, broadcast_q=True)(**kw),
    ),
    "target_attention": (
        _target_inputs,
        lambda **kw: _target(ops.target_attention)(**kw),
        lambda **kw: _target(reference.target_attention_reference)(**kw),
    ),
}


@pytest.mark.parametrize("op_name", list(OP_CASES))
@pytest.mark.slow
def test_compiled_matches_eager(op_name: str, device: torch.device, empty_library) -> None:
    """The fake implementations and autograd registrations let torch.compile trace a caller in one
    graph; the compiled forward and gradients equal the eager ones."""
    make_inputs, op, _ = OP_CASES[op_name]
    inputs = make_inputs(device)

    def loss(**kw):
        out = op(**kw)
        return out, (out * out).sum()

    results = {}
    for name, fn in [("eager", loss), ("compiled", torch.compile(loss, backend="aot_eager", fullgraph=True))]:
        leaves = {
            n: (t.clone().requires_grad_() if t is not None and t.is_floating_point() else t)
            for n, t in inputs.items()
        }
        out, total = fn(**leaves)
        total.backward()
        results[name] = [out.detach()] + [
            t.grad for t in leaves.values() if t is not None and t.is_floating_point()
        ]
    for eager, compiled in zip(results["eager"], results["compiled"], strict=True):
        torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("op_name", list(OP_CASES))
def test_eager_calls_bypass_the_custom_op_and_traced_calls_use_it(
    op_name: str, device: torch.device, empty_library, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Plain eager calls (with and without gradients) run the implementation directly; calls on
    fake tensors, as torch.compile and export trace them, go through the registered custom op."""
    make_inputs, op, _ = OP_CASES[op_name]
    inputs = make_inputs(device)
    eager = getattr(ops, op_name).eager
    custom_op_calls = []

    def counted(*args):
        custom_op_calls.append(args)
        return eager_op(*args)

    eager_op = eager.op
    monkeypatch.setattr(eager, "op", counted)
    with torch.no_grad():
        plain = op(**inputs)
    leaves = {
        n: (t.clone().requires_grad_() if t is not None and t.is_floating_point() else t)
        for n, t in inputs.items()
    }
    out = op(**leaves)
    out.sum().backward()
    assert custom_op_calls == []
    torch.testing.assert_close(out.detach(), plain, rtol=0, atol=0)
    assert all(t.grad is not None for t in leaves.values() if t is not None and t.is_floating_point())

    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fakes = {n: None if t is None else mode.from_tensor(t) for n, t in inputs.items()}
        fake_out = op(**fakes)
    assert len(custom_op_calls) == 1
    assert fake_out.shape == plain.shape


@pytest.mark.parametrize("op_name", list(OP_CASES))
def test_op_without_triton_falls_back_to_reference(
    op_name: str, empty_library, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CPU tensors without the interpreter: the forward is the reference, the backward its vjp."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    make_inputs, op, ref = OP_CASES[op_name]
    check_against_reference(op, ref, make_inputs(torch.device("cpu")), "fp32", f"{op_name} without Triton")
    assert DISPATCHER.last[op_name] == "reference"


# --- properties over random jagged lengths --------------------------------------------------

PROPERTY_SETTINGS = settings(
    max_examples=4, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@PROPERTY_SETTINGS
@given(
    lengths=st.lists(st.integers(0, 40), min_size=1, max_size=4),
    activation=st.sampled_from(["softmax", "silu"]),
    causal=st.booleans(),
    with_targets=st.booleans(),
    with_bias=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
@pytest.mark.slow
def test_property_jagged_attention(
    device: torch.device,
    lengths: list[int],
    activation: str,
    causal: bool,
    with_targets: bool,
    with_bias: bool,
    seed: int,
) -> None:
    targets = torch.Generator().manual_seed(seed)
    num_targets = torch.randint(0, 6, (len(lengths),), generator=targets).tolist() if with_targets else None
    inputs = _jagged_inputs(device, lengths=lengths, targets=num_targets, bias=with_bias, seed=seed)
    options = {"max_seq_len": max(lengths), "activation": activation, "causal": causal}
    check_against_reference(
        _jagged(ops.jagged_attention, **options),
        _jagged(reference.jagged_attention_reference, **options),
        inputs,
        "fp32",
        f"jagged_attention lengths={lengths} targets={num_targets} bias={with_bias} {options}",
    )


@PROPERTY_SETTINGS
@given(
    lengths=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), min_size=1, max_size=4),
    activation=st.sampled_from(["gelu", "silu", "relu", "none"]),
    broadcast_q=st.booleans(),
    num_seeds=st.integers(1, 20),
    seed=st.integers(0, 2**31 - 1),
)
@pytest.mark.slow
def test_property_gdpa(
    device: torch.device,
    lengths: list[tuple[int, int]],
    activation: str,
    broadcast_q: bool,
    num_seeds: int,
    seed: int,
) -> None:
    q_lengths, kv_lengths = [n for n, _ in lengths], [n for _, n in lengths]
    inputs = _gdpa_inputs(
        device,
        broadcast_q=broadcast_q,
        q_lengths=q_lengths,
        kv_lengths=kv_lengths,
        num_seeds=num_seeds,
        seed=seed,
    )
    options = {"activation": activation, "broadcast_q": broadcast_q}
    check_against_reference(
        _gdpa(ops.gdpa, **options),
        _gdpa(reference.gdpa_reference, **options),
        inputs,
        "fp32",
        f"gdpa q={q_lengths} kv={kv_lengths} seeds={num_seeds} {options}",
    )


@PROPERTY_SETTINGS
@given(
    kv_lengths=st.lists(st.integers(0, 40), min_size=1, max_size=4),
    num_cand=st.integers(0, 8),
    seeds=st.integers(1, 4),
    activation=st.sampled_from(["softmax", "silu"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_property_target_attention(
    device: torch.device, kv_lengths: list[int], num_cand: int, seeds: int, activation: str, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    requests = torch.randint(0, len(kv_lengths), (num_cand,), generator=gen).tolist()
    inputs = _target_inputs(device, cand_to_request=requests, kv_lengths=kv_lengths, seeds=seeds, seed=seed)
    options = {"activation": activation}
    check_against_reference(
        _target(ops.target_attention, **options),
        _target(reference.target_attention_reference, **options),
        inputs,
        "fp32",
        f"target_attention kv={kv_lengths} requests={requests} seeds={seeds} {options}",
    )


# --- input validation -----------------------------------------------------------------------


def _jagged_call(device: torch.device, changes: dict[str, Callable[[dict], object]]) -> Callable[[], object]:
    """ops.jagged_attention on valid small inputs, with `changes` (name -> new value from the
    arguments) applied."""
    args = _jagged_inputs(device, lengths=[3, 2], targets=[1, 0], bias=True)
    args |= {"max_seq_len": 3, "activation": "softmax"}
    args |= {name: change(args) for name, change in changes.items()}
    return lambda: ops.jagged_attention(
        args.pop("q"), args.pop("k"), args.pop("v"), args.pop("offsets"), **args
    )


JAGGED_BAD = {
    "q-2d": ({"q": lambda a: a["q"][:, 0]}, "q must be"),
    "heads-differ": ({"k": lambda a: a["k"][:, :1], "v": lambda a: a["v"][:, :1]}, "same heads"),
    "v-dim-differs": ({"v": lambda a: torch.cat([a["v"], a["v"]], -1)}, "same shape"),
    "dims-differ": ({"q": lambda a: a["q"][..., :8]}, "same heads and head dim"),
    "dtype-mismatch": ({"k": lambda a: a["k"].half()}, "share a dtype"),
    "tokens-differ": ({"k": lambda a: a["k"][:4], "v": lambda a: a["v"][:4]}, "as many k/v tokens"),
    "offsets-2d": ({"offsets": lambda a: a["offsets"][None]}, "offsets"),
    "offsets-float": ({"offsets": lambda a: a["offsets"].float()}, "int32 or int64"),
    "unknown-activation": ({"activation": lambda a: "gelu"}, "activations softmax, silu"),
    "num-targets-length": ({"num_targets": lambda a: a["num_targets"][:1]}, "num_targets"),
    "rel-bias-heads": ({"rel_bias": lambda a: a["rel_bias"][:1]}, "rel_bias"),
    "rel-bias-buckets": ({"rel_bias": lambda a: a["rel_bias"][:, :6]}, "twice a power of two"),
    "max-seq-len": ({"max_seq_len": lambda a: -1}, "max_seq_len"),
}


@pytest.mark.parametrize("case", list(JAGGED_BAD))
def test_jagged_attention_rejects_bad_input(case: str, device: torch.device) -> None:
    changes, message = JAGGED_BAD[case]
    with pytest.raises(ValueError, match=message):
        _jagged_call(device, changes)()


@pytest.mark.parametrize("head_dim", [8, 24, 512])
def test_head_dim_must_be_a_power_of_two(head_dim: int, device: torch.device) -> None:
    q = torch.randn(4, 2, head_dim, device=device)
    with pytest.raises(ValueError, match="power of two from 16 to 256"):
        ops.jagged_attention(q, q, q, torch.tensor([0, 4], device=device), max_seq_len=4)


def test_gdpa_and_target_attention_reject_bad_input(device: torch.device) -> None:
    g = _gdpa_inputs(device)
    with pytest.raises(ValueError, match="needs q_offsets"):
        ops.gdpa(g["q"], g["k"], g["v"], None, g["kv_offsets"])
    with pytest.raises(ValueError, match="q_offsets has 3 entries"):
        ops.gdpa(g["q"], g["k"], g["v"], g["q_offsets"][:3], g["kv_offsets"])
    with pytest.raises(ValueError, match="activations gelu, silu, relu, none"):
        ops.gdpa(g["q"], g["k"], g["v"], g["q_offsets"], g["kv_offsets"], activation="softmax")
    with pytest.raises(ValueError, match="kv_offsets must rise from 0"):
        attn.gdpa_forward(g["q"], g["k"], g["v"], g["q_offsets"], g["kv_offsets"] - 1)
    with pytest.raises(ValueError, match="max_q_len and max_kv_len go together"):
        ops.gdpa(g["q"], g["k"], g["v"], g["q_offsets"], g["kv_offsets"], max_kv_len=40)
    with pytest.raises(ValueError, match="max_q_len must be an int >= 0, got -1"):
        ops.gdpa(g["q"], g["k"], g["v"], g["q_offsets"], g["kv_offsets"], max_q_len=-1, max_kv_len=40)
    b = _gdpa_inputs(device, broadcast_q=True)
    with pytest.raises(ValueError, match="no max_q_len with broadcast_q"):
        ops.gdpa(b["q"], b["k"], b["v"], None, b["kv_offsets"], broadcast_q=True, max_q_len=4, max_kv_len=40)
    with pytest.raises(ValueError, match="max_kv_len must be an int >= 0, got 2.5"):
        attn.gdpa_backward(
            b["q"], b["q"], b["k"], b["v"], None, b["kv_offsets"], broadcast_q=True, max_kv_len=2.5
        )
    t = _target_inputs(device)
    with pytest.raises(ValueError, match="q_cand must be"):
        ops.target_attention(t["q_cand"][0], t["k"], t["v"], t["kv_offsets"], t["cand_to_request"])
    with pytest.raises(ValueError, match="cand_to_request must be"):
        ops.target_attention(t["q_cand"], t["k"], t["v"], t["kv_offsets"], t["cand_to_request"][:2])
    with pytest.raises(ValueError, match="activations softmax, silu"):
        ops.target_attention(
            t["q_cand"], t["k"], t["v"], t["kv_offsets"], t["cand_to_request"], activation="relu"
        )
    with pytest.raises(ValueError, match=r"cand_to_request must lie in \[0, 5\)"):
        attn.target_attention_forward(t["q_cand"], t["k"], t["v"], t["kv_offsets"], t["cand_to_request"] + 3)
    with pytest.raises(ValueError, match="block_m must be a power of two"):
        attn.gdpa_forward(g["q"], g["k"], g["v"], g["q_offsets"], g["kv_offsets"], block_m=24)


# --- a GPU at realistic sizes ---------------------------------------------------------------

REALISTIC = {"heads": 4, "dim": 128}  # bf16, D = 128: the production head shape


def _realistic_lengths(gen: torch.Generator, count: int, longest: int) -> list[int]:
    lengths = torch.randint(0, longest + 1, (count,), generator=gen).tolist()
    lengths[0] = longest  # one sequence at the maximum, the rest anywhere below
    return lengths


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["softmax", "silu"])
def test_jagged_attention_realistic_on_gpu(activation: str, empty_library) -> None:
    """B = 8 sequences up to 1024 tokens, H = 4, D = 128, bf16, 16 targets each and a 64-bucket
    relative bias, with the default GPU launch configuration, forward and backward."""
    gen = torch.Generator().manual_seed(0)
    lengths = _realistic_lengths(gen, 8, 1024)
    inputs = _jagged_inputs(
        torch.device("cuda"),
        "bf16",
        lengths=lengths,
        targets=[16] * 8,
        bias=True,
        num_buckets=64,
        **REALISTIC,
    )
    options = {"max_seq_len": 1024, "activation": activation, "causal": True}
    check_against_reference(
        _jagged(ops.jagged_attention, **options),
        _jagged(reference.jagged_attention_reference, **options),
        inputs,
        "bf16",
        f"jagged_attention lengths={lengths} {options}",
    )


@pytest.mark.gpu
@pytest.mark.parametrize("broadcast_q", [False, True], ids=["jagged-q", "broadcast-q"])
def test_gdpa_realistic_on_gpu(broadcast_q: bool, empty_library) -> None:
    """8 samples, queries up to 256 (or 64 shared seeds) against histories up to 1024, D = 128."""
    gen = torch.Generator().manual_seed(1)
    q_lengths, kv_lengths = _realistic_lengths(gen, 8, 256), _realistic_lengths(gen, 8, 1024)
    inputs = _gdpa_inputs(
        torch.device("cuda"), "bf16", broadcast_q=broadcast_q, q_lengths=q_lengths, kv_lengths=kv_lengths,
        num_seeds=64, **REALISTIC,
    )  # fmt: skip
    options = {"activation": "gelu", "broadcast_q": broadcast_q}
    check_against_reference(
        _gdpa(ops.gdpa, **options),
        _gdpa(reference.gdpa_reference, **options),
        inputs,
        "bf16",
        f"gdpa q={q_lengths} kv={kv_lengths} {options}",
    )


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["softmax", "silu"])
def test_target_attention_realistic_on_gpu(activation: str, empty_library) -> None:
    """64 candidates x 4 seeds spread over 8 requests with histories up to 1024, D = 128."""
    gen = torch.Generator().manual_seed(2)
    kv_lengths = _realistic_lengths(gen, 8, 1024)
    requests = torch.randint(0, 8, (64,), generator=gen).tolist()
    inputs = _target_inputs(
        torch.device("cuda"), "bf16", cand_to_request=requests, kv_lengths=kv_lengths, seeds=4, **REALISTIC
    )
    options = {"activation": activation}
    check_against_reference(
        _target(ops.target_attention, **options),
        _target(reference.target_attention_reference, **options),
        inputs,
        "bf16",
        f"target_attention kv={kv_lengths} {options}",
    )


def _assert_sync_free_and_graphable(step: Callable[[], tuple[torch.Tensor, ...]]) -> None:
    """step() runs with CUDA's sync debug mode set to raise, and a CUDA graph of it replays to
    the eager result, bit for bit."""
    eager = step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up on a side stream, as graph capture asks
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(captured, eager, strict=True):
        assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["softmax", "silu"])
@pytest.mark.parametrize("grouping", ["ranks", "torch"])
def test_target_attention_with_bounds_never_syncs_and_replays_in_a_cuda_graph(
    activation: str, grouping: str, empty_library, monkeypatch
) -> None:
    """With max_candidates and max_history the op, forward and backward, syncs never and
    replays from a CUDA graph; with the one-launch grouping and with the torch ops used beyond
    RANK_SORT_MAX candidates."""
    if grouping == "torch":
        monkeypatch.setattr(kit, "RANK_SORT_MAX", 0)
    gen = torch.Generator().manual_seed(3)
    kv_lengths = _realistic_lengths(gen, 8, 1024)
    requests = torch.randint(0, 8, (64,), generator=gen).tolist()
    t = _target_inputs(
        torch.device("cuda"), "bf16", cand_to_request=requests, kv_lengths=kv_lengths, seeds=4, **REALISTIC
    )
    bounds = {"max_candidates": max(requests.count(r) for r in range(8)), "max_history": max(kv_lengths)}
    q_cand = t["q_cand"].requires_grad_()
    args = (q_cand, t["k"], t["v"], t["kv_offsets"], t["cand_to_request"])
    grad_out = torch.randn_like(q_cand)

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        out = ops.target_attention(*args, activation=activation, **bounds)
        (dq,) = torch.autograd.grad(out, q_cand, grad_out)
        # Detached, so that no autograd graph (and its node of the leaf q_cand, tied to the
        # stream it was made on) outlives the step into the capture.
        return out.detach(), dq

    _assert_sync_free_and_graphable(step)


@pytest.mark.gpu
@pytest.mark.parametrize("broadcast_q", [False, True], ids=["jagged-q", "broadcast-q"])
def test_gdpa_with_bounds_never_syncs_and_replays_in_a_cuda_graph(broadcast_q: bool, empty_library) -> None:
    """With max_kv_len (and max_q_len for jagged queries) gdpa, forward and backward, syncs
    never and replays from a CUDA graph."""
    gen = torch.Generator().manual_seed(5)
    q_lengths, kv_lengths = _realistic_lengths(gen, 8, 512), _realistic_lengths(gen, 8, 256)
    g = _gdpa_inputs(
        torch.device("cuda"), "bf16", broadcast_q=broadcast_q, q_lengths=q_lengths, kv_lengths=kv_lengths,
        num_seeds=64, **REALISTIC,
    )  # fmt: skip
    bounds = {"max_kv_len": max(kv_lengths)} | ({} if broadcast_q else {"max_q_len": max(q_lengths)})
    q, k = g["q"].requires_grad_(), g["k"].requires_grad_()
    args = (q, k, g["v"], g["q_offsets"], g["kv_offsets"])
    rows = 8 * 64 if broadcast_q else sum(q_lengths)
    grad_out = torch.randn((rows, *q.shape[1:]), device=q.device, dtype=q.dtype)

    def step() -> tuple[torch.Tensor, ...]:
        out = ops.gdpa(*args, activation="gelu", broadcast_q=broadcast_q, **bounds)
        dq, dk = torch.autograd.grad(out, (q, k), grad_out)
        return out.detach(), dq, dk

    _assert_sync_free_and_graphable(step)


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["softmax", "silu"])
def test_tma_forward_equals_pointer_loads_on_gpu(activation: str) -> None:
    """The forward with TMA boxes for keys and values (rows past a sequence read from the next
    one, then masked) gives the pointer loads' output bit for bit, with targets, for jagged
    attention and for gdpa."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs compute capability 9.0")
    gen = torch.Generator().manual_seed(4)
    lengths = _realistic_lengths(gen, 8, 1024)
    t = _jagged_inputs(torch.device("cuda"), "bf16", lengths=lengths, targets=[16] * 8, **REALISTIC)
    args = (t["q"], t["k"], t["v"], t["offsets"])
    options = {"max_seq_len": max(lengths), "activation": activation, "num_targets": t["num_targets"]}
    tiles = {"block_m": 128, "block_n": 64}  # the same tiles either way, for identical sums
    pointer = attn.jagged_attention_forward(*args, **options, **tiles, return_lse=True, tma=False)
    boxes = attn.jagged_attention_forward(*args, **options, **tiles, return_lse=True, tma=True)
    assert torch.equal(boxes[0], pointer[0])
    if activation == "softmax":
        assert torch.equal(boxes[1], pointer[1])
    g = _gdpa_inputs(torch.device("cuda"), "bf16", **REALISTIC)
    gdpa_args = (g["q"], g["k"], g["v"], g["q_offsets"], g["kv_offsets"])
    assert torch.equal(attn.gdpa_forward(*gdpa_args, tma=True), attn.gdpa_forward(*gdpa_args, tma=False))


def _register_templates(library, op: str, dtype: str, bucket: str) -> list[str]:
    """The forward and gradient problems' templates at their default knobs, registered for this
    GPU and the call's bucket, as a campaign would: the kernel ids."""
    from kernels.registry import device_arch
    from search_space.template import get_template

    ids = []
    for problem in (op, f"{op}_grad"):
        template = get_template(problem)
        entry = library.add(
            op=problem, entry=template.entry, source=template.render(template.defaults()),
            arch=device_arch(torch.device("cuda")), dtype=dtype, buckets=[bucket], median_us=1.0,
            interpreted=False, evidence={}, provenance={"test": "graph capture"},
        )  # fmt: skip
        ids.append(entry.kernel_id)
    return ids


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["target_attention", "gdpa", "jagged_attention"])
def test_registered_kernels_keep_the_op_sync_free_and_capturable(op: str, empty_library) -> None:
    """A campaign's kernels receive the op's bounds (the problems pass them to every candidate),
    so with registered forward and gradient kernels the op, forward and backward, still syncs
    never and replays from a CUDA graph; dispatch ran the library's kernels."""
    from search_space.attention_common import bucket_of

    gen = torch.Generator().manual_seed(11)
    if op == "target_attention":
        kv_lengths = _realistic_lengths(gen, 8, 1024)
        requests = torch.randint(0, 8, (64,), generator=gen).tolist()
        t = _target_inputs(
            torch.device("cuda"),
            "bf16",
            cand_to_request=requests,
            kv_lengths=kv_lengths,
            seeds=4,
            **REALISTIC,
        )
        bounds = {"max_candidates": max(requests.count(r) for r in range(8)), "max_history": max(kv_lengths)}
        leaf = t["q_cand"].requires_grad_()
        args = (leaf, t["k"], t["v"], t["kv_offsets"], t["cand_to_request"])
        call, grad_out = ops.target_attention, torch.randn_like(leaf)
        bucket = bucket_of(REALISTIC["dim"], bounds["max_history"])
    elif op == "jagged_attention":  # a training step's forward: it saves lse for the backward
        lengths = _realistic_lengths(gen, 8, 1024)
        j = _jagged_inputs(
            torch.device("cuda"), "bf16", lengths=lengths, targets=[16] * 8, bias=True, num_buckets=64,
            **REALISTIC,
        )  # fmt: skip
        bounds = {"max_seq_len": 1024}
        leaf = j["q"].requires_grad_()
        args = (leaf, j["k"], j["v"], j["offsets"])
        call = functools.partial(ops.jagged_attention, num_targets=j["num_targets"], rel_bias=j["rel_bias"])
        grad_out = torch.randn_like(leaf)
        bucket = bucket_of(REALISTIC["dim"], bounds["max_seq_len"])
    else:
        q_lengths, kv_lengths = _realistic_lengths(gen, 8, 512), _realistic_lengths(gen, 8, 256)
        g = _gdpa_inputs(
            torch.device("cuda"), "bf16", broadcast_q=False, q_lengths=q_lengths, kv_lengths=kv_lengths,
            num_seeds=64, **REALISTIC,
        )  # fmt: skip
        bounds = {"max_kv_len": max(kv_lengths), "max_q_len": max(q_lengths)}
        leaf = g["q"].requires_grad_()
        args = (leaf, g["k"], g["v"], g["q_offsets"], g["kv_offsets"])
        call, grad_out = (
            ops.gdpa,
            torch.randn((sum(q_lengths), *leaf.shape[1:]), device="cuda", dtype=leaf.dtype),
        )
        bucket = bucket_of(REALISTIC["dim"], bounds["max_kv_len"])
    forward_id, grad_id = _register_templates(empty_library, op, "bf16", bucket)

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        out = call(*args, **bounds)
        (dq,) = torch.autograd.grad(out, leaf, grad_out)
        return out.detach(), dq

    _assert_sync_free_and_graphable(step)
    assert DISPATCHER.last[op] == f"library:{forward_id}"
    assert DISPATCHER.last[f"{op}_grad"] == f"library:{grad_id}"
