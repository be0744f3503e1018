"""Patch 0004's edits to upstream's interface.py: _flash_attn_bwd on SM120 takes the table's config, runs
FlashAttentionBackwardSm120Tuned, widens the preprocess pass for short tiles, and allocates the deterministic
turn counters with the package's ordering rule; check_plan_call holds the package to the same call.
"""

from __future__ import annotations

import inspect
import itertools

from flash_attn_sm120 import driver_bwd as pkg_driver_bwd
from flash_attn_sm120.kernels import bwd_sm120 as pkg_bwd

from patchgen.core import AnchorError
from patchgen.step_bwd_configs import PLAN_WHERE

WHERE = "flash_attn_sm120/kernels/bwd_sm120.py"


_BWD_INTERFACE_EDITS = (
    (
        "import of the SM120 tuned backward",
        "from flash_attn.cute.flash_bwd_sm120 import FlashAttentionBackwardSm120\n",
        "from flash_attn.cute.flash_bwd_sm120 import FlashAttentionBackwardSm120\n"
        "from flash_attn.cute.flash_bwd_sm120_configs import sm120_bwd_config, sm120_bwd_deterministic_plan\n"
        "from flash_attn.cute.flash_bwd_sm120_tuned import FlashAttentionBackwardSm120Tuned\n"
        "from flash_attn.cute.flash_bwd_sm120_tuned import preprocess_multiple as sm120_bwd_preprocess_multiple\n",
    ),
    (
        "SM120 backward config from the table",
        "        assert deterministic is False, \"deterministic backward not supported on SM 12.0\"\n",
        "        # SM120: warps, tiles, stages, atom layouts and swaps from the measured backward table\n"
        "        # (flash_bwd_sm120_configs.py), run by FlashAttentionBackwardSm120Tuned; where no config\n"
        "        # runs the head dims, the earlier default above and FlashAttentionBackwardSm120\n"
        "        sm120_bwd_cfg = sm120_bwd_config(head_dim, head_dim_v, causal, local)\n"
        "        if sm120_bwd_cfg is not None:\n"
        "            m_block_size, n_block_size = sm120_bwd_cfg.m_block, sm120_bwd_cfg.n_block\n"
        "            num_stages_Q, num_stages_dO = sm120_bwd_cfg.stages_q, sm120_bwd_cfg.stages_do\n"
        "            SdP_swapAB, dKV_swapAB, dQ_swapAB = (\n"
        "                sm120_bwd_cfg.sdp_swapab, sm120_bwd_cfg.dkv_swapab, sm120_bwd_cfg.dq_swapab\n"
        "            )\n"
        "            AtomLayoutMSdP, AtomLayoutNdKV, AtomLayoutMdQ = (\n"
        "                sm120_bwd_cfg.atom_m_sdp, sm120_bwd_cfg.atom_n_dkv, sm120_bwd_cfg.atom_m_dq\n"
        "            )\n"
        "            V_in_regs = sm120_bwd_cfg.v_in_regs\n"
        "            num_threads = sm120_bwd_cfg.num_threads\n"
        "        assert not deterministic or sm120_bwd_cfg is not None, (\n"
        "            \"deterministic backward not supported on SM 12.0 for these head dims\"\n"
        "        )\n",
    ),
    (
        "SM120 deterministic semaphores and dQ order",
        "    # The dedicated hd256 backward is deterministic without semaphores.\n"
        "    if deterministic and not use_dedicated_hd256_kernel:\n",
        "    sm120_det_plan = {}  # SM120's deterministic ordering: FlashAttentionBackwardSm120Tuned's keywords\n"
        "    if deterministic and arch // 10 == 12:\n"
        "        # SM120 (flash_bwd_sm120_tuned.py): int32 turn counters per (batch, head, m_block) for dQ\n"
        "        # and per (batch, KV head, n_block) for GQA dK/dV (dK's serves dV too); the dQ order:\n"
        "        # descending turns with the n_blocks launched shortest first for causal and windows, the rotated\n"
        "        # order without a mask when a head's n_blocks are resident, else ascending\n"
        "        sm120_det_plan = sm120_bwd_deterministic_plan(\n"
        "            get_num_sms_for_selection(device.index, arch), sm120_bwd_cfg, causal, seqlen_q, seqlen_k,\n"
        "            local=local,  # a window's turns count from its edges (dq_turn)\n"
        "            index_tensors=(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k),\n"
        "        )\n"
        "        dQ_semaphore = torch.zeros(\n"
        "            batch_size, num_head, max(seqlen_q_rounded // m_block_size, 1), dtype=torch.int32, device=device\n"
        "        )\n"
        "        dK_semaphore = (\n"
        "            torch.zeros(\n"
        "                batch_size, num_head_kv, max(seqlen_k_rounded // n_block_size, 1), dtype=torch.int32,\n"
        "                device=device,\n"
        "            )\n"
        "            if qhead_per_kvhead > 1\n"
        "            else None\n"
        "        )\n"
        "        dV_semaphore = None\n"
        "    # The dedicated hd256 backward is deterministic without semaphores.\n"
        "    elif deterministic and not use_dedicated_hd256_kernel:\n",
    ),
    (
        "SM120 widens the preprocess pass for short tiles",
        "    _bwd_preprocess(\n"
        "        out, dout, dpsum, lse, lse_log2, dq_accum,\n"
        "        cu_seqlens_q, seqused_q, dlse,\n"
        "        dtype, head_dim, head_dim_v, m_block_size,\n"
        "        cu_total_m_blocks=cu_total_m_blocks_q,\n"
        "        fake_mode=fake_mode,\n"
        "        hdim_multiple_of=hdim_multiple_of,\n"
        "    )\n",
        "    # SM120: a preprocess pass must not cover more rows than a short m_block (its last m_block of a\n"
        "    # head would zero the next head's first dPsum rows); a wider head-dim multiple (a wider k-block,\n"
        "    # the columns past head_dim_v predicated off) covers fewer, and dQaccum, whose layout keeps\n"
        "    # hdim_multiple_of, is then zeroed here\n"
        "    preprocess_hdim_multiple = hdim_multiple_of\n"
        "    if arch // 10 == 12 and sm120_bwd_cfg is not None:\n"
        "        preprocess_hdim_multiple = sm120_bwd_preprocess_multiple(head_dim_v, m_block_size)\n"
        "    preprocess_zeroes_dq = preprocess_hdim_multiple == hdim_multiple_of\n"
        "    if not preprocess_zeroes_dq and dq_accum is not None:\n"
        "        dq_accum.zero_()\n"
        "    _bwd_preprocess(\n"
        "        out, dout, dpsum, lse, lse_log2, dq_accum if preprocess_zeroes_dq else None,\n"
        "        cu_seqlens_q, seqused_q, dlse,\n"
        "        dtype, head_dim, head_dim_v, m_block_size,\n"
        "        cu_total_m_blocks=cu_total_m_blocks_q,\n"
        "        fake_mode=fake_mode,\n"
        "        hdim_multiple_of=preprocess_hdim_multiple,\n"
        "    )\n",
    ),
    (
        "SM120 keeps its dK/dV semaphores",
        "    if deterministic and qhead_per_kvhead > 1 and not use_dedicated_hd256_kernel:\n",
        "    if deterministic and arch // 10 == 12:\n"
        "        pass  # set above\n"
        "    elif deterministic and qhead_per_kvhead > 1 and not use_dedicated_hd256_kernel:\n",
    ),
    (
        "the dQ ordering joins the compile key",
        "            dQ_single_wg,\n"
        "            deterministic,\n",
        "            dQ_single_wg,\n"
        "            deterministic,\n"
        "            tuple(sm120_det_plan.items()),\n",
    ),
    (
        "SM120 semaphores are 3-D",
        "        dQ_semaphore_tensor, dK_semaphore_tensor, dV_semaphore_tensor = [\n"
        "            utils.convert_from_dlpack_leading_static(t.detach(), leading_dim=3, alignment=4, stride_order=t.dim_order())\n"
        "            if t is not None else None\n"
        "            for t in (dQ_semaphore, dK_semaphore, dV_semaphore)\n"
        "        ]\n",
        "        dQ_semaphore_tensor, dK_semaphore_tensor, dV_semaphore_tensor = [\n"
        "            (\n"
        "                to_cute_tensor(t, assumed_align=4)  # SM120: (batch, head, block), read element-wise\n"
        "                if arch // 10 == 12\n"
        "                else utils.convert_from_dlpack_leading_static(\n"
        "                    t.detach(), leading_dim=3, alignment=4, stride_order=t.dim_order()\n"
        "                )\n"
        "            )\n"
        "            if t is not None else None\n"
        "            for t in (dQ_semaphore, dK_semaphore, dV_semaphore)\n"
        "        ]\n",
    ),
    (
        "SM120 builds the tuned class",
        "        if arch // 10 in [8, 12]:\n"
        "            flash_bwd_obj_cls = FlashAttentionBackwardSm120 if arch // 10 == 12 else FlashAttentionBackwardSm80\n",
        "        if arch // 10 == 12 and sm120_bwd_cfg is not None:\n"
        "            fa_bwd_obj = FlashAttentionBackwardSm120Tuned(\n"
        "                dtype,\n"
        "                head_dim,\n"
        "                head_dim_v,\n"
        "                qhead_per_kvhead,\n"
        "                sm120_bwd_cfg,\n"
        "                pack_gqa=pack_gqa,\n"
        "                is_causal=causal,\n"
        "                is_local=local,\n"
        "                score_mod=score_mod,\n"
        "                score_mod_bwd=score_mod_bwd,\n"
        "                deterministic=deterministic,\n"
        "                # masks only on the tiles that hold a masked element, without a causal mask or window\n"
        "                mask_where_needed=not causal and not local,\n"
        "                **sm120_det_plan,\n"
        "            )\n"
        "        elif arch // 10 in [8, 12]:\n"
        "            flash_bwd_obj_cls = FlashAttentionBackwardSm120 if arch // 10 == 12 else FlashAttentionBackwardSm80\n",
    ),
    (
        "SM120 postprocess in the main kernel's thread layout",
        "        else:\n"
        "            num_threads_post_dQ = 128\n"
        "            num_threads_post_dKV = 128\n",
        "        elif arch // 10 == 12:\n"
        "            # SM120: the postprocess reads the accumulators in the main kernel's thread layout\n"
        "            # (its warps, with the atom layouts and swaps passed below)\n"
        "            num_threads_post_dQ = num_threads_post_dKV = num_threads\n"
        "        else:\n"
        "            num_threads_post_dQ = 128\n"
        "            num_threads_post_dKV = 128\n",
    ),
)


def check_plan_call() -> None:
    """AnchorError unless the package calls deterministic_plan as the patched interface calls
    sm120_bwd_deterministic_plan (same arguments, the result as the kernel's keywords) and the kernel
    takes every ordering flag as a keyword."""
    sig = list(inspect.signature(pkg_driver_bwd.deterministic_plan).parameters)
    # (modifier_step keeps its patched default, False: the interface builds the tuned class; so do
    # fixed_point: the interface allocates no int64 dQ accumulator and keeps the turn orders, windows
    # included (it passes local); and rotated_entry: the patched table has no turns entries)
    if sig != ["num_sms", "cfg", "causal", "seqlen_q", "seqlen_k", "index_tensors", "modifier_step", "fixed_point",
               "local", "rotated_entry"]:
        raise AnchorError(f"{PLAN_WHERE}: takes {sig}; revisit the interface's sm120_bwd_deterministic_plan call")
    backward = " ".join(inspect.getsource(pkg_driver_bwd.backward).split())
    call = ("**(deterministic_plan(device_info(q.device).num_sms, cfg, causal, seqlen_q, seqlen_k, index_tensors=( "
            "cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k), fixed_point=fixed_point, local=local, "
            "rotated_entry=kinds[\"turns\"] and rotated_entry) if deterministic else {})")
    if call not in backward:
        raise AnchorError("flash_attn_sm120/driver_bwd.py: backward() no longer calls deterministic_plan as the "
                          "patched interface does; revisit the interface edits in step_bwd.py")
    if "**ordering_flags(statics)" not in inspect.getsource(pkg_driver_bwd.make_kernel):
        raise AnchorError("flash_attn_sm120/driver_bwd.py: make_kernel no longer passes the plan as the kernel's keywords")
    # the interface passes mask_where_needed=not causal and not local and no lpt: the package's launch_plan
    for causal, local, det, dense in itertools.product((False, True), repeat=4):
        plan = pkg_driver_bwd.launch_plan(causal, local, det, dense_k=dense)
        if plan != dict(lpt=False, mask_where_needed=not causal and not local, dq_wide_adds=False, own_step=False):
            raise AnchorError(f"flash_attn_sm120/driver_bwd.py: launch_plan{(causal, local, det, dense)} = {plan}; "
                              "the patched interface passes mask_where_needed=not causal and not local, no lpt, "
                              "no dq_wide_adds (upstream's postprocess reads the accumulator), no own_step")
    if "**launch_plan(causal, local, bool(deterministic), dense_k=not varlen_k)" not in backward:
        raise AnchorError("flash_attn_sm120/driver_bwd.py: backward() no longer takes launch_plan's flags")
    kwargs = inspect.signature(pkg_bwd.FlashAttentionBackwardSm120Tuned.__init__).parameters
    missing = [f for f in pkg_driver_bwd._ORDERING_FLAGS if kwargs.get(f) is None or kwargs[f].default is not False]
    if missing:
        raise AnchorError(f"{WHERE}: FlashAttentionBackwardSm120Tuned takes no keyword {missing} defaulting to False")
