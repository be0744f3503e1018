"""One-sided negative windows on every forward family, against the fp32 reference (GPU).

Upstream FA4's meaning (validation.window_bounds): a window is unbounded only when both sides are
negative; (None, -r) attends to keys at least r before the diagonal, (-l, None) to keys at least
l after it, so some rows attend to nothing (out 0, LSE -inf). Each case runs through
`testing.run_case`: NaN-poisoned outputs, every valid element checked against the fp32 reference
with upstream's error rule, LSE -inf exactly on empty rows.
"""

import pytest

torch = pytest.importorskip("torch")

from flash_attn_sm120 import testing  # noqa: E402
from flash_attn_sm120.paths import get_path  # noqa: E402
from flash_attn_sm120.testing import AttnCase, AttnProblem  # noqa: E402

pytestmark = pytest.mark.gpu

# (mask, left, right): the mask kind says which sides the API call carries
WINDOWS = [
    ("local_r", None, -1),  # strictly before the diagonal
    ("local_r", None, -70),  # crosses tile boundaries; the first rows are empty
    ("local_l", -1, None),  # strictly after the diagonal
    ("local_l", -70, None),
    ("local_lr", -3, 40),  # band [diag + 3, diag + 40]
    ("local_lr", 40, -3),  # band [diag - 40, diag - 3]
    ("local_lr", -2, -9),  # both negative: no window at all
    ("causal_l", -5, None),  # causal with a negative left side: every row empty
]

DENSE_PATHS = ["cpasync-table", "cpasync-w8-128x96-s1", "cpasync-w4-64x64-s2", "upstream-config", "tma-w8-128x64-s2"]


@pytest.mark.parametrize("mask,left,right", WINDOWS, ids=[f"{m}[{l},{r}]" for m, l, r in WINDOWS])
@pytest.mark.parametrize("path", DENSE_PATHS)
def test_dense_families(path, mask, left, right):
    case = AttnCase(dtype="bfloat16", head_dim=128, head_dim_v=128, qhead_per_kvhead=2, mask=mask, return_lse=True)
    for sq, sk in ((200, 333), (333, 200)):
        problem = AttnProblem((sq, sq), (sk, sk), nheads_kv=2, window_left=left, window_right=right, seed=sq)
        testing.run_case(path, "driver", case, problem)


@pytest.mark.parametrize("mask,left,right", WINDOWS[:6], ids=[f"{m}[{l},{r}]" for m, l, r in WINDOWS[:6]])
def test_varlen_cpasync(mask, left, right):
    case = AttnCase(head_dim=64, head_dim_v=64, mask=mask, return_lse=True, q_layout="packed", k_layout="packed")
    problem = AttnProblem((0, 77, 300), (50, 0, 260), nheads_kv=2, window_left=left, window_right=right, seed=5)
    testing.run_case("cpasync-table", "public", case, problem)


@pytest.mark.parametrize("mask,left,right", WINDOWS[:6], ids=[f"{m}[{l},{r}]" for m, l, r in WINDOWS[:6]])
def test_splitkv_paged_and_decode(mask, left, right):
    """SplitKV over paged K/V (a split can own no unmasked key), and a decode-shaped call through
    the dispatcher's decode table."""
    split = AttnCase(head_dim=128, head_dim_v=128, qhead_per_kvhead=4, mask=mask, return_lse=True,
                     q_layout="packed", k_layout="paged")
    problem = AttnProblem((3, 1), (900, 517), nheads_kv=2, window_left=left, window_right=right, page_size=64,
                          num_splits=3, seed=9)
    testing.run_case("splitkv-w4-64x64", "public", split, problem)
    decode = AttnCase(head_dim=128, head_dim_v=128, qhead_per_kvhead=8, mask=mask, return_lse=True)
    testing.run_case("cpasync-table", "public", decode,
                     AttnProblem((1, 1), (1500, 1500), nheads_kv=1, window_left=left, window_right=right, seed=3))
