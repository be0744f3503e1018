"""Window semantics pinned to upstream FA4's, case by case (CPU).

Upstream treats a window as unbounded only when *both* sides are negative; one negative side is a
real bound that moves the band off the diagonal: (None, -1) attends only to keys strictly before
it. This package once read -1 on either side as "unbounded" (FA2 style), a silently different
result for a caller migrating from FA4. These tests tie the API, the resolver the kernels get, and
the reference masks to upstream's `_resolve_causal_local_window`.
"""

import itertools

import pytest
import torch
from flash_attn.cute.interface import _resolve_causal_local_window

from flash_attn_sm120 import bench, testing, validation

SIDES = (None, -70, -3, -1, 0, 1, 5)


def _mask_from_upstream(sq: int, sk: int, causal: bool, left, right) -> torch.Tensor:
    """The mask upstream's resolved (causal, local, left, right) describes, written out directly."""
    causal, local, left, right = _resolve_causal_local_window(causal, left, right)
    rows = torch.arange(sq)[:, None] + (sk - sq)
    cols = torch.arange(sk)[None, :]
    if causal:
        return cols > rows
    mask = torch.zeros(sq, sk, dtype=torch.bool)
    if local:
        if right is not None:
            mask |= cols > rows + right
        if left is not None:
            mask |= cols < rows - left
    return mask


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("left,right", list(itertools.product(SIDES, SIDES)))
def test_reference_mask_is_upstreams(causal, left, right):
    for sq, sk in ((6, 6), (3, 9), (9, 4)):
        l, r = validation.normalize_window((left, right))
        ours = bench.window_mask(sq, sk, causal, (l, r), "cpu")
        assert torch.equal(ours, _mask_from_upstream(sq, sk, causal, left, right)), (sq, sk)


def test_one_negative_side_is_a_bound():
    # (None, -1): keys strictly before the diagonal; row 0 attends to nothing
    m = bench.window_mask(4, 4, False, (None, -1), "cpu")
    assert m[0].all() and m[1].tolist() == [False, True, True, True]
    # (-2, None): keys two or more after the diagonal
    m = bench.window_mask(4, 4, False, (-2, None), "cpu")
    assert m[0].tolist() == [True, True, False, False] and m[2:].all()
    # both negative: no window at all (and the reference skips the mask)
    assert testing.attention_mask(4, 4, False, (-1, -5), "cpu") is None
    assert testing.attention_mask(4, 4, False, (None, -1), "cpu") is not None


@pytest.mark.parametrize("window,want", [
    ((None, -1), (None, -1)), ((-1, None), (-1, None)), ((-1, -1), (-1, -1)), ((-7, 3), (-7, 3)),
    ((3, -7), (3, -7)), (None, (None, None)), ([4, 0], (4, 0)),
    ((-(1 << 40), None), (-(1 << 30), None)), ((None, 1 << 40), (None, 1 << 30)),
])
def test_normalize_keeps_values(window, want):
    """Values pass through unchanged (the driver applies upstream's resolver); magnitudes past
    any int32 sequence are clamped, which keeps the mask and avoids int32 overflow."""
    assert validation.normalize_window(window) == want


@pytest.mark.parametrize("left,right", list(itertools.product(SIDES, SIDES)))
def test_clamp_keeps_meaning(left, right):
    big = {None: None}
    for x in SIDES:
        if x is not None:
            big[x] = x * (1 << 40) if x else 0
    l, r = validation.normalize_window((big[left], big[right]))
    resolved = _resolve_causal_local_window(False, big[left], big[right])
    assert _resolve_causal_local_window(False, l, r)[:2] == resolved[:2]


@pytest.mark.parametrize("bad,exc", [((1.5, 0), TypeError), ((True, 0), TypeError), ((0, "1"), TypeError),
                                     ((1, 2, 3), TypeError), ("ab", TypeError)])
def test_normalize_rejects(bad, exc):
    with pytest.raises(exc, match="window_size"):
        validation.normalize_window(bad)


def test_attention_ref_one_sided_negative_window():
    """The differentiable reference (backward tests) follows the same rule, empty rows included."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 5, 2, 16, generator=g) for _ in range(3))
    out, lse = testing.attention_ref(q, k, v, window=(None, -1))
    assert torch.isneginf(lse[..., 0]).all() and (out[:, 0] == 0).all()
    # row 1 sees key 0 only
    torch.testing.assert_close(out[:, 1], v[:, 0])
    full, _ = testing.attention_ref(q, k, v, window=(-1, -1))
    none, _ = testing.attention_ref(q, k, v)
    torch.testing.assert_close(full, none)
