"""The backward's plans: how a call's kernel is launched and, with deterministic=True, how it orders its dQ
additions. Pure functions of a call's static facts (driver_bwd.py puts their flags into the compile key and
passes them to the kernel as keywords, kernels/bwd_sm120.py):

  * launch_plan: the longest-first causal launch (an option), masks only on the tiles that need one, and
    dQ added four fp32 elements at a time (an option);
  * deterministic_plan: the dQ turn order (ascending, descending with the shortest-first launch, rotated) and
    the release protocol (kernels/bwd_deterministic.py), refusing what could deadlock;
  * SPARSE_DETERMINISTIC_PLAN: the block-sparse walk's order (turns from its lists);
  * force_launch_plan / force_deterministic_plan: context managers for benchmarks and tests.
"""

from __future__ import annotations

from flash_attn_sm120.kernels.bwd_tiling import BwdConfig


_LAUNCH_FLAGS = ("lpt", "mask_where_needed", "dq_wide_adds", "own_step")
_forced_launch: list[dict] = []


class _Forced:
    """Context manager: the plan's callers inside see these flags (`stack`: the plan's list of forced flags,
    `known`: its flag names, `what`: their name in the error)."""

    stack: list
    known: tuple
    what: str

    def __init__(self, **flags: bool):
        unknown = set(flags) - set(self.known)
        if unknown:
            raise ValueError(f"unknown {self.what} {sorted(unknown)}; known: {self.known}")
        self.flags = flags

    def __enter__(self):
        self.stack.append(self.flags)
        return self

    def __exit__(self, *exc):
        self.stack.pop()


class force_launch_plan(_Forced):
    """Context manager: backwards inside use these launch_plan flags (benchmarks of what each is worth)."""

    stack, known, what = _forced_launch, _LAUNCH_FLAGS, "launch flags"


def launch_plan(causal: bool, local: bool, deterministic: bool, dense_k: bool) -> dict:
    """How the backward launches its CTAs and masks its tiles (kernels/bwd_sm120.py), as measured
    (configs/measurements/2026-12-03_bwd_launch_plan_emulated.json, same run, emulated):

    * mask_where_needed: without a causal mask or window, only the last n_block of a sequence masks
      (bwd_mask.where_needed): +0.1% to +2.4% on the 4 non-causal seed problems. With a causal mask
      the runtime branch measured -3% to +4% (geomean -0.5%), so causal tiles mask every step as before;
      a window masks every tile anyway.
    * lpt: off. The longest-first causal launch (LongestFirstNBlockScheduler) measured +5% at b2 s4096 d128
      and -4% to -7% at b1 s8192 d128 and d96 (geomean -2%); it stays a forced option (force_launch_plan),
      allowed for a causal mask without a window, deterministic=False and no cu_seqlens_k.
    * dq_wide_adds: off until measured. dQ added with 16-byte reductions into an accumulator laid out four
      elements per thread, read back by this package's postprocess (kernels/bwd_postprocess.py); a forced
      option. Every config bwd_config_error admits splits that way (kernels/bwd_sm120.dq_wide_fits). The
      gradients are the same either way, up to the order of the fp32 additions.
    * own_step: off. This package's step (kernels/bwd_mods.py) instead of upstream's for a call without
      modifiers, as the wide adds run it: a forced option, to tell what the step and the adds are each worth.
    """
    lpt_allowed = causal and not local and not deterministic and dense_k
    plan = dict(lpt=False, mask_where_needed=not causal and not local, dq_wide_adds=False, own_step=False)
    if _forced_launch:
        plan.update(_forced_launch[-1])
    if plan["lpt"] and not lpt_allowed:
        raise ValueError("lpt needs a causal mask without a window, deterministic=False and no cu_seqlens_k")
    return plan


_ORDERING_FLAGS = ("dq_descending", "dq_rotated", "reverse_n_blocks", "fetch_early", "barrier_release",
                   "release_deferred", "fetch_relaxed", "warp_turns", "late_dq_adds", "diag_no_wait",
                   "diag_no_sync", "dq_split", "fused_turns", "fused_fetch", "dq_fixed_point")
# the block-sparse walk's deterministic order (kernels/bwd_block_sparse.py): ascending turns per listed tile,
# given by its lists, on the modifier step's own barriers
SPARSE_DETERMINISTIC_PLAN = {**dict.fromkeys(_ORDERING_FLAGS, False), "fused_turns": True}
# dQ in 64-bit fixed point (kernels/bwd_fixed_point.py): no turns, any window, any walk
FIXED_POINT_PLAN = {**dict.fromkeys(_ORDERING_FLAGS, False), "dq_fixed_point": True}
# the flags that need kernels/bwd_mods.py's step
_OWN_STEP_FLAGS = ("late_dq_adds", "dq_split", "fused_turns", "fused_fetch", "dq_fixed_point", "dq_wide_adds",
                   "own_step")
_forced_plan: list[dict] = []


class force_deterministic_plan(_Forced):
    """Context manager: deterministic backwards inside use these ordering flags (benchmarks and tests
    of the orderings; the flags' rules are the caller's to respect, see deterministic_plan). The
    diag_* flags are timing diagnostics whose gradients are NOT deterministic."""

    stack, known, what = _forced_plan, _ORDERING_FLAGS, "deterministic ordering flags"


def plan_forced() -> bool:
    """Whether a force_deterministic_plan is active (its calls keep their key's entries: config_bwd's turns
    entries are measured and spill-checked with the plan's own ordering only)."""
    return bool(_forced_plan)


def fixed_point_allowed(user_score_mod: bool) -> bool:
    """Whether a deterministic call may add dQ in fixed point (kernels/bwd_fixed_point.py): its bound holds
    without a user's score_mod_bwd (softcap's is covered), for dense, varlen and block-sparse calls alike."""
    return not user_score_mod


def dq_takes_turns(fixed_point: bool, causal: bool, local: bool, dense: bool,
                   rotated_entry: bool = False) -> bool:
    """Whether a deterministic call's dQ adds take turns (else fixed point), the deterministic plan's first
    rule: fixed point wherever the call allows it (`fixed_point`) but a dense causal or windowed call
    (descending turns) and a dense call without a mask that its key's turns entry serves in the rotated order
    (`rotated_entry`: the table has one whose rotated walk fits the call, rotated_entry_fits). dense: no
    cu_seqlens or seqused. Windows, the same dense calls without a score_mod timed both ways in one process
    (session 39, emulated on an H100, gate_2026-12-07_session39/w51b/det_windows.json): the descending turns
    0.875 / 0.867 / 0.831x the default backward, fixed point 0.725 / 0.724 / 0.598x (172 vs 143, 172 vs 143,
    109 vs 78 TFLOPS). Packed windows stay in fixed point (0.72x; ascending turns 0.26x, session 38)."""
    rotated = rotated_entry and dense and not (causal or local)
    return not fixed_point or (dense and (causal or local)) or rotated


def rotated_walk_fits(cfg: BwdConfig, seqlen_q: int, seqlen_k: int, num_sms: int) -> bool:
    """Whether the rotated dQ order admits a dense call without a mask on this config: a head's n_blocks
    number at most its m_blocks and are resident (at most num_sms: one CTA per SM, the least any shipped
    config runs)."""
    n_blocks, m_blocks = -(-seqlen_k // cfg.n_block), -(-seqlen_q // cfg.m_block)
    return n_blocks <= m_blocks and n_blocks <= num_sms


def rotated_entry_fits(cfg: BwdConfig, seqlen_q: int, seqlen_k: int, num_sms: int) -> bool:
    """Whether a dense call without a mask takes a "none" key's turns entry (`cfg`) in the rotated order:
    rotated_walk_fits with half the SMs. The rotated order waits on CTAs of the same head, which must launch;
    the margin keeps a head's n_blocks resident while other streams' kernels (collectives, an MPS share) hold
    up to half the GPU. Calls past it add dQ in fixed point on the key's other entry."""
    return rotated_walk_fits(cfg, seqlen_q, seqlen_k, num_sms // 2)


def deterministic_plan(num_sms: int, cfg: BwdConfig, causal: bool, seqlen_q: int, seqlen_k: int,
                       index_tensors: tuple = (None, None, None, None), modifier_step: bool = True,
                       fixed_point: bool = False, local: bool = False, rotated_entry: bool = False) -> dict:
    """How the deterministic backward orders its dQ additions.

    * Fixed point, where the call allows it (`fixed_point`: fixed_point_allowed), for every call but a
      dense causal one or one a rotated turns entry serves (`rotated_entry`): no order at all. Each dQ
      contribution is added as a 64-bit fixed-point integer, whose sum has the same bits in any order (kernels/bwd_fixed_point.py); no CTA waits. Measured
      against the turns (emulated, H200, same runs, session 33): packed documents 0.736x the default
      backward against 0.375x (varlen calls can only take ascending turns); dense without a mask
      +7% to +14% over the rotated turns.

    Otherwise (dense causal calls, where the descending turns measured 1-13% faster; dense calls without a
    mask whose key has a turns entry that runs the rotated order, `rotated_entry`, where that entry's
    tile measured +27% over fixed point at d96; calls with a user score_mod or score_mod_bwd, windows
    included) turns (kernels/bwd_deterministic.py):

    * Causal or a window, without cu_seqlens_k or seqused_k: descending turns with the n_blocks
      launched shortest first, so that every wait is for a CTA launched earlier (no residency
      condition). With a two-sided window the CTAs walk about equal counts, so the launch order costs
      little balance there; with a left side only the shortest walks launch first, as with causal.
    * No mask, dense: the rotated order when a head's n_blocks fit on the GPU at once and number at
      most its m_blocks: no CTA waits in steady state. It assumes this kernel gets at least one CTA on
      every SM and that CTAs start in launch order (as upstream's ordered backwards do); a kernel
      sharing the GPU stalls it until its SMs free up.
    * Otherwise (more n_blocks than m_blocks or than SMs, varlen): ascending turns, as the n_block CTAs
      launch, counted from each m_block's first n_block (a window's left edge).
    The shipped plans place the turns on the step's own barriers (fused_turns: thread 0 waits right
    before the barrier ahead of the dQ adds and releases the previous m_block right after the one ahead
    of the dP product), which needs this package's step (kernels/bwd_mods.py). With
    `modifier_step=False` (upstream's step) a turn is released as CUTLASS's semaphore does (CTA
    barrier, one release increment), deferred to the next m_block, where the loads the release's
    fence would wait for have landed.
    num_sms: the GPU's (a head's n_blocks are resident when they number at most that: 1 CTA per SM,
    the least any shipped config runs). `index_tensors`:
    cu_seqlens_q/k, seqused_q/k."""
    cu_q, cu_k, used_q, used_k = (t is not None for t in index_tensors)
    dense = not (cu_q or cu_k or used_q or used_k)
    n_blocks, m_blocks = -(-seqlen_k // cfg.n_block), -(-seqlen_q // cfg.m_block)
    resident = not cu_k and n_blocks <= num_sms  # varlen: the scheduler's launch order differs
    if _forced_plan:
        plan = {f: bool(_forced_plan[-1].get(f, False)) for f in _ORDERING_FLAGS}
        if plan["dq_fixed_point"] and not fixed_point:
            raise ValueError("dq_fixed_point's bound does not cover this call (a user's score_mod_bwd)")
    elif not dq_takes_turns(fixed_point, causal, local, dense, rotated_entry):
        return dict(FIXED_POINT_PLAN)
    else:
        plan = dict.fromkeys(_ORDERING_FLAGS, False)
        if modifier_step:
            plan.update(fused_turns=True)
        else:
            plan.update(barrier_release=True, release_deferred=True)
        if (causal or local) and not (cu_k or used_k):
            # (with seqused_k the grid's n_blocks past the used keys still visit the last m_blocks, which
            # descending turns counted from the used keys would not wait for: turn -1, a hang)
            plan.update(dq_descending=True, reverse_n_blocks=True)
        elif not causal and dense and rotated_walk_fits(cfg, seqlen_q, seqlen_k, num_sms):
            plan.update(dq_rotated=True)
    # an order that can deadlock is refused, forced or not (a hang is the one failure with no message)
    if plan["dq_descending"] and not (causal or local):
        plan["dq_descending"] = False  # the kernel ignores it without a causal or local mask; keep the key canonical
    if plan["dq_descending"] and used_k:
        raise ValueError("descending dQ turns are counted from the used keys: not with seqused_k")
    if plan["dq_rotated"] and (causal or not dense
                               or not rotated_walk_fits(cfg, seqlen_q, seqlen_k, num_sms)):
        raise ValueError("the rotated dQ order needs a dense problem without a causal mask whose n_blocks are "
                         f"resident and at most its m_blocks ({n_blocks} n_blocks, {m_blocks} m_blocks)")
    if plan["dq_split"] and (cu_q or cu_k):
        raise ValueError("dq_split needs dense dQ accumulators: not with cu_seqlens_q / cu_seqlens_k")
    if plan["dq_split"] and local and not plan["dq_fixed_point"]:
        raise ValueError("dq_split groups the n_blocks by n % 2, which a window's turns do not follow")
    if plan["reverse_n_blocks"] and (cu_k or not (plan["dq_descending"] or resident)):
        raise ValueError("the reversed n_block launch needs a dense problem and descending turns or resident n_blocks")
    if plan["dq_descending"] and not plan["reverse_n_blocks"] and not resident:
        raise ValueError("descending dQ turns with the ascending launch need a head's n_blocks resident")
    return plan
