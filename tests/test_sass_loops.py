"""scripts/sass_loops.py on a CPU: loops read from SASS text (a backward branch closes one)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import sass_loops  # noqa: E402


def _sass(lines: list[tuple[int, str]]) -> str:
    return "\n".join(f"        /*{a:04x}*/                   {t} ;   /* 0x000000000000000000 */\n" for a, t in lines)


def test_a_backward_branch_closes_a_loop_with_its_counts():
    text = _sass([
        (0x0100, "MOV R1, R2"),
        (0x0110, "HMMA.16816.F32.BF16 R4, R8, R12, R4"),
        (0x0120, "FMUL R4, R4, R20"),
        (0x0130, "MOV R5, R21"),
        (0x0140, "@P0 BRA 0x110"),  # back to 0x110: three instructions and the branch
        (0x0150, "@!P1 BRA 0x180"),  # forward: no loop
        (0x0160, "BRA.U UP0, 0x100"),  # a uniform branch back to the start: the whole span
        (0x0170, "EXIT"),
    ])
    found = sass_loops.loops(text)
    assert found == [
        sass_loops.Loop(0x110, 0x140, instructions=4, hmma=1, mov=1),
        sass_loops.Loop(0x100, 0x160, instructions=7, hmma=1, mov=2),
    ]


def test_predicated_moves_count_and_other_opcodes_do_not():
    text = _sass([
        (0x0200, "@P2 MOV R1, R2"),
        (0x0210, "MOVM.16.MT88 R3, R4"),
        (0x0220, "UMOV UR4, 0x0"),
        (0x0230, "@!P0 BRA 0x200"),
    ])
    (loop,) = sass_loops.loops(text)
    assert (loop.instructions, loop.hmma, loop.mov) == (4, 0, 1)


def test_a_return_from_code_past_the_exit_is_not_a_loop():
    text = _sass([
        (0x0300, "HMMA.16816.F32.BF16 R4, R8, R12, R4"),
        (0x0310, "@!P0 BRA 0x330"),  # the wait failed: its retry, out of line
        (0x0320, "EXIT"),
        (0x0330, "NANOSLEEP 0x20"),
        (0x0340, "@!P0 BRA 0x330"),  # the retry spins (a loop)
        (0x0350, "BRA 0x310"),  # and returns across the EXIT: not a loop
    ])
    assert sass_loops.loops(text) == [sass_loops.Loop(0x330, 0x340, 2, 0, 0)]
